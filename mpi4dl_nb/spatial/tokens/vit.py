"""timm vision transformers (VisionTransformer, Eva) on token tiles: patch embedding on the tile, blocks, pooled head.
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from ..family import PATCH_EMBED, Family, TimmMatch, names_family, refused, timm_classes
from ..layer import Convert, SpatialRuntime, shallow_copy, spatial_class
from ..tile_marks import layout_of, mark_tiled
from .attention import TOKEN_TILES
from .pools import class_token, mean_of_tokens
from .position import add_positions, built_grid, tile_rope
from .tiles import TokenTiles, check_patch_grid, int_pair

POOLS = ("token", "avg", "map")
VIT_MODELS = ("timm.models.vision_transformer.VisionTransformer", "timm.models.eva.Eva")
HYBRID_EMBED = ("timm.layers.HybridEmbed",)


class TokenRopeBlock(nn.Module):
    """Mixin: a cut Eva's block on this rank's token tile, with the rotary embedding of the global token grid
    sliced to the tile's tokens (as ``position.tile_rope`` slices the whole model's)."""

    tile_runtime: SpatialRuntime
    rotary: nn.Module              # the piece's (models/vit.RopeBlock): the rotary embedding of the built grid
    grid: tuple[int, int]
    block: Callable[[], nn.Module]   # the Eva block the piece runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles = self.tile_runtime.plans.get(TOKEN_TILES)
        if not isinstance(tiles, TokenTiles):
            raise ValueError("a cut Eva's block on tiles runs after its embedding piece on the same spatial stage")
        rope: Any = self.rotary   # timm's rotary embeddings: get_embed() for their own grid, else shape=
        with torch._C.DisableTorchFunction():
            full = rope.get_embed() if hasattr(rope, "feat_shape") else rope.get_embed(shape=list(self.grid))
            own = full.index_select(-2, torch.tensor(tiles.token_indices(), device=full.device))
        out: torch.Tensor = self.block()(x, rope=own)
        return out


class TokenEmbedder(nn.Module):
    """Mixin: timm's patch embedding, ``_pos_embed`` and ``norm_pre`` on this rank's image tile."""

    tile_runtime: SpatialRuntime
    serial_class: type[nn.Module]

    def tile_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, TokenTiles, torch.Tensor | None]:
        """timm's patch embedding, ``_pos_embed`` and ``norm_pre`` on this rank's image tile: its token tile, the
        token geometry, and its slice of the rotary embedding (None without rope). Within a spatial forward."""
        runtime = self.tile_runtime
        _check_training(self)
        tokens, tiles = _embed(self, x, runtime)
        runtime.plans[TOKEN_TILES] = tiles
        layout = layout_of(tokens)
        with torch._C.DisableTorchFunction():
            tokens = add_positions(self, tokens, tiles, runtime.ctx, runtime.group)
            rope = tile_rope(self, tiles, runtime.ctx, runtime.group)
        return self.get_submodule("norm_pre")(mark_tiled(tokens, layout)), tiles, rope


class TokenStem(TokenEmbedder):
    """Mixin: a cut ViT's embedding piece on this rank's image tile; its output, this tile's tokens ``(B, n, C)``
    (the token-tile representation of ``tokens/tiles.py``), is what the blocks after it on the stage take."""

    source: type[nn.Module]                   # the piece's (models/vit.TokenEmbedding): the model class it cuts
    image_steps: Callable[[], list[nn.Module]]   # the steps before the patch embedding (a normalisation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.image_steps():
            x = step(x)
        tokens, _, rope = self.tile_tokens(x)
        assert rope is None, "a cut Eva's rotary embedding is its block pieces' (TokenRopeBlock)"
        return tokens


class TokenModel(TokenEmbedder):
    """Mixin: a timm VisionTransformer/Eva's forward on this rank's tile (the model's output on every rank)."""

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise ConfigError("model", f"{self.serial_class.__name__} with attn_mask/is_causal is not supported "
                              f"on tiles; call it without them")
        tokens, tiles, rope = self.tile_tokens(x)
        tokens = self.run_blocks(tokens, rope, range(len(list(self.get_submodule("blocks").children()))))
        return self.tile_head(tokens, tiles)

    def run_blocks(self, tokens: torch.Tensor, rope: torch.Tensor | None, indices: range) -> torch.Tensor:
        """The blocks ``indices`` on a token tile (the rope as ``tile_tokens`` gave it)."""
        blocks = list(self.get_submodule("blocks").children())
        mixed = bool(getattr(self, "rope_mixed", False))
        for index in indices:
            block = blocks[index]
            tokens = block(tokens) if rope is None else block(tokens, rope=rope[index] if mixed else rope)
        return tokens

    def tile_head(self, tokens: torch.Tensor, tiles: TokenTiles) -> torch.Tensor:
        """timm's final ``norm`` and ``forward_head`` on a token tile: the output, the same on every rank."""
        pooled = self._pool(self.get_submodule("norm")(tokens), tiles)
        for name in ("fc_norm", "head_drop", "head"):
            pooled = self.get_submodule(name)(pooled)
        return pooled

    def _pool(self, tokens: torch.Tensor, tiles: TokenTiles) -> torch.Tensor:
        """timm's ``pool`` on token tiles: one replicated vector per image."""
        runtime = self.tile_runtime
        attention_pool = getattr(self, "attn_pool", None)
        if isinstance(attention_pool, nn.Module):   # its attention spans the tiles: not under DisableTorchFunction
            include_prefix = bool(getattr(self, "pool_include_prefix", True))   # Eva's pools every token
            layout, skip = layout_of(tokens), 0 if include_prefix else tiles.prefix_here
            runtime.plans[TOKEN_TILES] = tiles if include_prefix else replace(tiles, num_prefix=0)
            with torch._C.DisableTorchFunction():
                image_tokens = tokens[:, skip:]
            pooled: torch.Tensor = attention_pool(mark_tiled(image_tokens, layout))
            return pooled
        with torch._C.DisableTorchFunction():
            if self.global_pool == "token":
                return class_token(tokens, tiles, runtime.ctx, runtime.group)
            return mean_of_tokens(tokens, tiles, runtime.ctx, runtime.group,
                                  include_prefix=bool(getattr(self, "pool_include_prefix", False)))


def _embed(model: nn.Module, x: torch.Tensor, runtime: SpatialRuntime) -> tuple[torch.Tensor, TokenTiles]:
    """The patch embedding on the tile: this tile's image tokens ``(B, h*w, C)`` and the token geometry."""
    embed = model.get_submodule("patch_embed")
    size = runtime.root_size
    assert size is not None and len(size) == 2
    dynamic = bool(getattr(model, "dynamic_img_size", False))
    if isinstance(embed, timm_classes(PATCH_EMBED)):
        token_grid = check_patch_grid(runtime.grid, (size[0], size[1]), int_pair(embed.patch_size))
        _check_built_size(model, token_grid, dynamic)
        tokens = embed.get_submodule("norm")(embed.get_submodule("proj")(x).flatten(2).transpose(1, 2))
    else:   # HybridEmbed: its CNN backbone and projection as spatial layers
        tokens = embed(x)
        token_grid = _hybrid_grid(model, runtime, layout_of(tokens).lengths(tokens.shape), dynamic)
    tiles = TokenTiles(runtime.grid, token_grid, runtime.tile, int(getattr(model, "num_prefix_tokens", 0)))
    if layout_of(tokens).lengths(tokens.shape) != tiles.shape:
        raise ValueError(f"patch embedding gave {layout_of(tokens).lengths(tokens.shape)} tokens on tile "
                         f"{runtime.tile}; its box of the {token_grid} token grid is {tiles.shape}")
    return tokens, tiles


def _check_built_size(model: nn.Module, token_grid: tuple[int, int], dynamic: bool) -> None:
    """A fixed-size model runs at the size it was built for only (timm asserts it)."""
    built = built_grid(model) if getattr(model.get_submodule("patch_embed"), "grid_size", None) else None
    if not dynamic and built and token_grid != built:
        raise ConfigError("image_size", f"{type(model).__name__} was built for a {built} token grid, the image gives "
                          f"{token_grid}; create it with img_size= the image's size or dynamic_img_size=True")


def _hybrid_grid(model: nn.Module, runtime: SpatialRuntime, local: tuple[int, int], dynamic: bool) -> tuple[int, int]:
    """The global token grid of a hybrid's feature map (one small all-gather per image size)."""
    key = (TOKEN_TILES, runtime.root_size)
    cached = runtime.plans.get(key)
    if not isinstance(cached, tuple):
        cached = runtime.plans[key] = runtime.gather_lengths(local)
    grid = (int(cached[0]), int(cached[1]))
    _check_built_size(model, grid, dynamic)
    return grid


def _check_model(model: nn.Module, name: str, runtime: SpatialRuntime) -> None:
    """Refuse before work what the token-tile forward does not compute exactly."""
    where = f"layer {name or '<root>'!r} ({type(model).__name__})"
    if type(model) not in timm_classes(VIT_MODELS):
        raise ConfigError("model", f"{where}: a subclass of {type(model).__mro__[1].__name__} with its own forward "
                          f"is not supported on tiles; supported: VisionTransformer and Eva as timm builds them")
    pool = getattr(model, "global_pool", None)
    if pool not in POOLS or (pool == "map") != (getattr(model, "attn_pool", None) is not None):
        raise ConfigError("model", f"{where}: global_pool={pool!r} is not supported on tiles yet; supported: "
                          f"{', '.join(POOLS)} (create the model with global_pool='avg' or 'token')")
    _check_embedding(model, where, runtime, type(model).__name__)


def _check_embedding(model: nn.Module, where: str, runtime: SpatialRuntime, what: str) -> None:
    """Refuse before work a patch embedding the token-tile forward does not compute exactly (``what``: the model's
    name in a refusal of the image size)."""
    embed = model.get_submodule("patch_embed")
    if getattr(embed, "dynamic_img_pad", False):
        raise ConfigError("model", f"{where}: dynamic_img_pad pads the image's edge on one tile; create the model "
                          f"without it (tiles hold whole patches)")
    if type(embed) not in timm_classes(PATCH_EMBED + HYBRID_EMBED):
        raise ConfigError("model", f"{where}: patch embedding {type(embed).__name__} is not supported on tiles; "
                          f"supported: PatchEmbed, HybridEmbed")
    image = getattr(embed, "img_size", None)
    if isinstance(embed, timm_classes(PATCH_EMBED)) and image and not getattr(model, "dynamic_img_size", False):
        check_patch_grid(runtime.grid, int_pair(image), int_pair(embed.patch_size), what)


def _check_training(model: nn.Module) -> None:
    """Refuse position/patch dropout in training: its mask would be drawn per tile, not for the whole sequence."""
    for name in ("pos_drop", "patch_drop"):
        layer = getattr(model, name, None)
        rate = getattr(layer, "p", getattr(layer, "prob", 0.0))
        if model.training and rate:
            raise ConfigError("model", f"{type(model).__name__}.{name} ({type(layer).__name__}, rate {rate}) in "
                              f"training is not supported on tiles; create the model with "
                              f"{'pos_drop_rate' if name == 'pos_drop' else 'patch_drop_rate'}=0")


def convert_token_model(module: nn.Module, name: str, runtime: SpatialRuntime, convert: Convert) -> nn.Module:
    """A timm VisionTransformer/Eva converted for token tiles."""
    _check_model(module, name, runtime)
    return _on_tiles(module, name, TokenModel, type(module), runtime, convert)


def convert_cut_embedding(module: nn.Module, name: str, runtime: SpatialRuntime, convert: Convert) -> nn.Module:
    """A cut ViT's embedding piece (``models/vit.TokenEmbedding``) as a ``TokenStem`` on token tiles."""
    source: type[nn.Module] = vars(module)["source"]   # the model class the piece cuts
    where = f"layer {name or '<root>'!r} (the embedding of a cut {source.__name__})"
    _check_embedding(module, where, runtime, source.__name__)
    return _on_tiles(module, name, TokenStem, source, runtime, convert)


def convert_rope_block(module: nn.Module, name: str, runtime: SpatialRuntime, convert: Convert) -> nn.Module:
    """A cut Eva's block piece (``models/vit.RopeBlock``) as a ``TokenRopeBlock``: its block converted, its rotary
    embedding sliced to the tile's tokens at each forward."""
    new = shallow_copy(module, spatial_class(TokenRopeBlock, type(module)))
    object.__setattr__(new, "tile_runtime", runtime)
    rotary = module.get_submodule("rotary")
    for child_name, child in module.named_children():
        new._modules[child_name] = child if child is rotary else convert(child, f"{name}.{child_name}")
    return new


def _on_tiles(module: nn.Module, name: str, mixin: type[TokenEmbedder], serial: type[nn.Module],
              runtime: SpatialRuntime, convert: Convert) -> nn.Module:
    """``module`` (a timm ViT/Eva, or a cut one's embedding piece) as ``mixin`` on tiles: its children converted,
    its patch embedding's forward replaced by ``_embed``'s, its own tensors tile shares."""
    new = shallow_copy(module, spatial_class(mixin, type(module)))
    object.__setattr__(new, "tile_runtime", runtime)
    object.__setattr__(new, "serial_class", serial)
    for child_name, child in module.named_children():
        full = f"{name}.{child_name}" if name else child_name
        if child_name == "patch_embed":   # its children converted, its forward replaced by _embed's
            embed = shallow_copy(child, type(child))
            for part_name, part in child.named_children():
                embed._modules[part_name] = convert(part, f"{full}.{part_name}")
            new._modules[child_name] = embed
            runtime.module_names.setdefault(id(embed), full)
        else:
            new._modules[child_name] = convert(child, full)
    for parameter_name in ("pos_embed", "cls_token", "reg_token"):
        parameter = getattr(module, parameter_name, None)
        if isinstance(parameter, nn.Parameter):
            runtime.claim_tile_share(parameter)
    rope = getattr(module, "rope", None)
    for parameter in rope.parameters() if isinstance(rope, nn.Module) else ():
        runtime.claim_tile_share(parameter)
    return new


VIT_MODEL = Family("ViT token model (timm VisionTransformer, Eva)", TimmMatch(VIT_MODELS), convert_token_model,
                   "tests/mpi/vit_exact.py")
LONE_EMBEDDING = Family("ViT token model (timm PatchEmbed, HybridEmbed outside one: refused)",
                        TimmMatch(PATCH_EMBED + HYBRID_EMBED), refused(
                            "a patch embedding outside timm's VisionTransformer/Eva is not supported on tiles (its "
                            "model's position embeddings and attention are not known to be exact there); put it "
                            "after the spatial stage"), "tests/mpi/vit_exact.py")
CUT_EMBEDDING: Family = Family("cut ViT pieces (models/vit.py's embedding piece)", lambda module: names_family(
    module, CUT_EMBEDDING), convert_cut_embedding, "tests/mpi/vit_exact.py")
CUT_ROPE_BLOCK: Family = Family("cut ViT pieces (models/vit.py's rotary block piece)", lambda module: names_family(
    module, CUT_ROPE_BLOCK), convert_rope_block, "tests/mpi/vit_exact.py")
