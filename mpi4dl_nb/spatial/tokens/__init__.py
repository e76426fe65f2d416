"""Vision transformers on token tiles: the tokens each tile holds, positions, ViT pieces, exact ring attention."""
