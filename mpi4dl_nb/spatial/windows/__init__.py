"""Attention over windows across tiles: Swin's shifted windows, MaxViT's partitions, EfficientViT's linear attention."""
