"""Vision transformers (timm's VisionTransformer and Eva) cut into pieces: the token embedding, each block, the head.

A ViT's ``forward`` is not a chain of its children: the patch embedding's tokens get the class and register
tokens and the position embedding from tensors of the model itself, and Eva's blocks take rotary embeddings
besides the tokens. The cut runs the model's own code on the pieces: ``TokenEmbedding`` holds the children
before ``blocks`` and the model's own tensors (``cls_token``, ``reg_token``, ``pos_embed``) and calls the
model class's ``_pos_embed`` on itself; every block is a piece (an Eva block with its rotary embedding, which
holds no weights); ``TokenHead`` holds the children after ``blocks`` (final norm, attention pool, fc norm,
head) and calls the class's ``forward_head``. Every module stays at its path in the model, so keys map as for
any cut model (``pieces.original_state_dict``); ``cut.layer_list`` checks the pieces against the model.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..config import ParallelConfig
from ..errors import ConfigError
from ..pipeline.handoff import TokenTiling
from ..pipeline.layer_decay import decay_scales
from ..spatial.geometry import TileGrid
from ..spatial.tokens.vit import CUT_EMBEDDING, CUT_ROPE_BLOCK
from .pieces import Piece
from .swin import SwinEmbedding

BLOCKS = "blocks"
EMBEDDING_STEP = "patch_embed"     # the step after which a TokenEmbedding adds prefix tokens and positions
SETTINGS = (bool, int, float, str, tuple, type(None))   # the plain attributes a piece copies from its model


def is_token_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ViT this cut takes: a patch embedding, a list of blocks, ``_pos_embed`` and
    ``forward_head`` (timm's VisionTransformer and Eva families, and models built like them)."""
    kind = type(model)
    blocks = getattr(model, BLOCKS, None)
    return (isinstance(getattr(model, EMBEDDING_STEP, None), nn.Module)
            and isinstance(blocks, nn.Sequential | nn.ModuleList)
            and all(callable(getattr(kind, name, None)) for name in ("_pos_embed", "forward_head", "pool")))


def patch_multiple(model: nn.Module) -> int:
    """The pixels one token covers along a side: the patch size (a hybrid's whole stem stride)."""
    embed = getattr(model, EMBEDDING_STEP)
    ratio = embed.feat_ratio(as_scalar=True) if callable(getattr(embed, "feat_ratio", None)) else embed.patch_size[0]
    return int(ratio)


def patch_grid_of(model: nn.Module) -> tuple[int, int]:
    """The token grid (rows, cols) the model was built for (its position embeddings')."""
    rows, cols = getattr(model, EMBEDDING_STEP).grid_size
    return int(rows), int(cols)


def token_image_size(model: nn.Module) -> tuple[int, int]:
    """The image size (rows, cols) the model was built for."""
    rows, cols = getattr(model, EMBEDDING_STEP).img_size
    return int(rows), int(cols)


def build_settings_of(model: nn.Module) -> dict[str, object]:
    """The model's plain attributes (``num_prefix_tokens``, ``global_pool``, ``no_embed_class`` ...): what its
    methods read besides modules and tensors."""
    return {name: value for name, value in vars(model).items()
            if not name.startswith("_") and name != "training" and isinstance(value, SETTINGS)}


class TokenEmbedding(Piece):
    """The patch embedding with the class/register tokens and the position embedding: the model class's
    ``_pos_embed`` run on this piece, which holds the model's own tensors and settings (on a spatial stage: the
    embedding on token tiles, ``spatial/tokens/vit.TokenStem``)."""

    tile_family = CUT_EMBEDDING

    def __init__(self, steps: Sequence[tuple[str, nn.Module]], source: type[nn.Module],
                 tensors: Mapping[str, nn.Parameter | None], settings: Mapping[str, object]) -> None:
        super().__init__(steps)
        self.source = source
        self.tensors = tuple(tensors)
        self.settings = dict(settings)
        for name, tensor in tensors.items():
            self.register_parameter(name, tensor)
        for name, value in self.settings.items():
            setattr(self, name, value)
        self.rope = None          # an Eva's rotary embedding is the blocks' (RopeBlock): none computed here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        built = token_image_size(self)
        if not self.settings.get("dynamic_img_size") and tuple(x.shape[-2:]) != built:
            raise ValueError(f"{self.source.__name__} was built for {built[0]}x{built[1]} images (--image-size), "
                             f"given {x.shape[-2]}x{x.shape[-1]}")
        for path in self.paths:
            x = self.get_submodule(path)(x)
            if path == EMBEDDING_STEP:
                x = self.with_positions(x)
        return x

    def image_steps(self) -> list[nn.Module]:
        """The steps before the patch embedding (a normalisation put in front), run on the image."""
        return [self.get_submodule(path) for path in self.paths[:self.paths.index(EMBEDDING_STEP)]]

    def with_positions(self, x: torch.Tensor) -> torch.Tensor:
        """The model's ``_pos_embed`` (an Eva's returns the rotary embedding too: left to the blocks)."""
        placed = self.source._pos_embed(self, x)   # type: ignore[attr-defined]  # checked by is_token_model
        return placed[0] if isinstance(placed, tuple) else placed

    def token_tiling(self, grid: TileGrid) -> TokenTiling:
        """Where this model's tokens lie on ``grid``'s tiles (its token grid, the prefix tokens on tile 0): what the
        hand-off to a layer stage joins (``pipeline/handoff.py``)."""
        count = self.settings.get("num_prefix_tokens", 0)
        return TokenTiling(grid, patch_grid_of(self), count if isinstance(count, int) else 0)

    def with_steps(self, steps: Sequence[tuple[str, nn.Module]]) -> Piece:
        params = {name: getattr(self, name) for name in self.tensors}
        return TokenEmbedding(steps, self.source, params, self.settings)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}; {self.source.__name__}._pos_embed after {EMBEDDING_STEP}"


class RopeBlock(Piece):
    """An Eva block and the rotary embedding it takes, computed from the model's token grid (no weights, the same
    for every block; on a spatial stage sliced per tile: ``spatial/tokens/vit.TokenRopeBlock``)."""

    tile_family = CUT_ROPE_BLOCK

    def __init__(self, path: str, block: nn.Module, rope: nn.Module, grid: tuple[int, int]) -> None:
        super().__init__([(path, block)])
        self.rotary = copy.deepcopy(rope)     # each piece its own: a stage's layers move alone
        self.grid = grid

    def block(self) -> nn.Module:
        return self.get_submodule(self.paths[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rope: Any = self.rotary     # timm's rotary embeddings: get_embed() for their own grid, else shape=
        embed = rope.get_embed() if hasattr(rope, "feat_shape") else rope.get_embed(shape=self.grid)
        out: torch.Tensor = self.block()(x, rope=embed)
        return out

    def with_steps(self, steps: Sequence[tuple[str, nn.Module]]) -> Piece:
        if len(steps) != 1:
            raise ValueError("a RopeBlock runs its block alone")
        return RopeBlock(steps[0][0], steps[0][1], self.rotary, self.grid)


class TokenHead(Piece):
    """The final norm, the token pool and the classifier: the model class's ``pool`` and ``forward_head`` run on
    this piece, after every step but the head's own."""

    def __init__(self, steps: Sequence[tuple[str, nn.Module]], source: type[nn.Module],
                 settings: Mapping[str, object], first: int) -> None:
        super().__init__(steps)
        self.source = source
        self.settings = dict(settings)
        self.first = first        # steps before forward_head's own (the final norm)
        for name, value in self.settings.items():
            setattr(self, name, value)
        for name in ("attn_pool", "fc_norm", "head_drop", "head"):
            if not hasattr(self, name):
                setattr(self, name, None)

    def pool(self, x: torch.Tensor, pool_type: str | None = None) -> torch.Tensor:
        """The model's token pool (class token, average, attention pool), as its ``forward_head`` calls it."""
        pooled: torch.Tensor = self.source.pool(self, x, pool_type)   # type: ignore[attr-defined]
        return pooled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for path in self.paths[:self.first]:
            x = self.get_submodule(path)(x)
        out: torch.Tensor = self.source.forward_head(self, x)   # type: ignore[attr-defined]
        return out

    def with_steps(self, steps: Sequence[tuple[str, nn.Module]]) -> Piece:
        raise ValueError("a ViT's head piece takes no other steps")


EMBEDDING_CHILDREN = ("patch_embed", "pos_drop", "patch_drop", "norm_pre")
HEAD_FIRST = ("norm",)                       # run before forward_head
HEAD_CHILDREN = ("attn_pool", "fc_norm", "head_drop", "head")
OWN_TENSORS = ("cls_token", "reg_token", "pos_embed")   # the model's own, used by _pos_embed
STATELESS = ("rope",)                        # children held by every block piece (no state-dict entries)


def refusal(model: nn.Module) -> str | None:
    """Why the cut cannot take ``model`` (None: it can)."""
    known = {*EMBEDDING_CHILDREN, BLOCKS, *HEAD_FIRST, *HEAD_CHILDREN, *STATELESS}
    other = [name for name, _ in model.named_children() if name not in known]
    if other:
        return f"children the cut does not know: {', '.join(other)}"
    if getattr(model, "rope_mixed", False):
        return "its rotary embedding is learnt per block (rope_mixed)"
    rope = getattr(model, "rope", None)
    if rope is not None and (any(True for _ in rope.parameters()) or rope.state_dict()):
        return "its rotary embedding holds weights"
    if rope is not None and getattr(model, "patch_drop", None) is not None:
        return "it drops patches (patch_drop) under a rotary embedding"
    if getattr(model, "dynamic_img_size", False) and rope is not None:
        return "dynamic_img_size with a rotary embedding"
    own = {name for name, _ in model.named_parameters(recurse=False)}
    unknown = own - set(OWN_TENSORS)
    if unknown:
        return f"tensors of its own the cut does not know: {', '.join(sorted(unknown))}"
    return None


def token_pieces(model: nn.Module) -> list[nn.Module]:
    """``model`` as pieces: ``TokenEmbedding``, every block, ``TokenHead``; ConfigError naming what the cut does
    not take."""
    reason = refusal(model)
    if reason is not None:
        raise ConfigError("model", f"{type(model).__name__} cannot be cut into a layer list: {reason}; build the "
                                   f"layer list yourself (modules whose nn.Sequential equals your model)")
    children = dict(model.named_children())
    source, settings = type(model), build_settings_of(model)
    embed = [(name, children[name]) for name in EMBEDDING_CHILDREN if name in children]
    tensors: dict[str, nn.Parameter | None] = {name: model._parameters[name] for name in OWN_TENSORS
                                               if name in model._parameters}
    pieces: list[nn.Module] = [TokenEmbedding(embed, source, tensors, settings)]
    rope = getattr(model, "rope", None)
    for index, block in enumerate(getattr(model, BLOCKS)):
        path = f"{BLOCKS}.{index}"
        pieces.append(Piece([(path, block)]) if rope is None else RopeBlock(path, block, rope, patch_grid_of(model)))
    first = [(name, children[name]) for name in HEAD_FIRST if name in children]
    head = [(name, children[name]) for name in HEAD_CHILDREN if name in children]
    pieces.append(TokenHead([*first, *head], source, settings, len(first)))
    return pieces


def blocks_of(layers: Sequence[nn.Module]) -> list[int]:
    """The indices of ``layers`` that hold one block of a cut ViT (in order)."""
    return [index for index, layer in enumerate(layers)
            if isinstance(layer, Piece) and len(layer.paths) == 1 and layer.paths[0].startswith(f"{BLOCKS}.")
            and layer.paths[0].removeprefix(f"{BLOCKS}.").isdigit()]


def is_cut_vit(layers: Sequence[nn.Module]) -> bool:
    """Whether ``layers`` are a ViT cut by ``token_pieces`` (a normalisation step in front allowed)."""
    return bool(layers) and isinstance(layers[0], TokenEmbedding) and isinstance(layers[-1], TokenHead)


def train_last_blocks(layers: Sequence[nn.Module], keep: int, label: str) -> str:
    """Freeze every parameter of a cut ViT but those of its last ``keep`` blocks and its head piece (final norm,
    pool, classifier): foundation-model fine-tuning. The line to print; ConfigError naming the fix for a model
    without blocks or ``keep`` above its depth."""
    blocks = blocks_of(layers)
    if not is_cut_vit(layers) or not blocks:
        raise ConfigError("--train-blocks", f"freezes all but the last blocks of a vision transformer; {label} is "
                                            f"not one (a timm ViT: --model timm:vit_small_patch16_224): drop "
                                            f"--train-blocks, or choose a ViT")
    if keep > len(blocks):
        raise ConfigError("--train-blocks", f"{keep}: {label} has {len(blocks)} blocks; use at most "
                                            f"{len(blocks)} (or drop --train-blocks to train them all)")
    trained = {*blocks[len(blocks) - keep:], len(layers) - 1}
    total = sum(p.numel() for layer in layers for p in layer.parameters())
    for index, layer in enumerate(layers):
        for p in layer.parameters():
            p.requires_grad_(index in trained)
    kept = sum(p.numel() for index in trained for p in layers[index].parameters())
    shown = f"blocks {len(blocks) - keep}-{len(blocks) - 1}, " if keep > 1 else (
        f"block {len(blocks) - 1}, " if keep else "")
    return (f"--train-blocks {keep}: training {shown}the final norm and the head of {label} ({kept:,} of {total:,} "
            f"parameters); the rest is frozen")


def layer_decay_scales(layers: Sequence[nn.Module], factor: float, label: str) -> dict[str, float]:
    """``--layer-decay``: every parameter's rate scale by its whole-model key (``nn.Sequential(*layers)``'s), BEiT's
    rule over the blocks of a cut ViT (``pipeline/layer_decay.py``); ConfigError naming the way out for a model
    without blocks."""
    blocks = blocks_of(layers)
    if not is_cut_vit(layers) or not blocks:
        raise ConfigError("--layer-decay", f"decays a vision transformer's rates block by block; {label} has no "
                                           f"transformer blocks (a timm ViT: --model timm:vit_small_patch16_224): "
                                           f"drop --layer-decay, or choose a ViT")
    keys = [name for name, _ in nn.Sequential(*layers).named_parameters()]
    return decay_scales(keys, blocks, factor)


def refuse_token_spatial_stage(layers: Sequence[nn.Module], cfg: ParallelConfig,
                               image_size: int | tuple[int, int] | None) -> None:
    """ConfigError before work for what a cut ViT cannot run on its spatial stage (the engine's cut at
    ``image_size``): a tile grid that cuts a patch, more than one spatial stage, the head piece on tiles; for a cut
    Swin (``models/swin.py``), a tile grid that cuts a patch."""
    if cfg.spatial_size and image_size is not None and layers and isinstance(layers[0], SwinEmbedding):
        check_tiled_patches(layers[0], TileGrid(*cfg.grid_shape), image_size, f"the {layers[0].model}")
    if cfg.spatial_size == 0 or not is_cut_vit(layers):
        return
    if cfg.spatial_size > 1:
        raise ConfigError("--spatial-size", f"{cfg.spatial_size}: a ViT's tokens run on one spatial stage (its "
                                            f"embedding and first blocks on token tiles, handed to the layer "
                                            f"stages after it); use --spatial-size 1")
    from ..pipeline.default_cut import default_balance

    if image_size is not None:
        check_tiled_patches(layers[0], TileGrid(*cfg.grid_shape), image_size)
    balance = default_balance(layers, cfg, image_size=image_size)
    count = balance[0]
    if isinstance(layers[count - 1], TokenHead):
        knob, fix = (("--balance", f"--balance {count - 1},{','.join(map(str, (balance[1] + 1, *balance[2:])))}")
                     if len(balance) > 1 else ("--split-size", f"--split-size {cfg.split_size + 1}"))
        raise ConfigError(knob, f"{list(balance)} puts the ViT's head (final norm, pool, classifier) on the "
                                f"spatial stage; end the spatial stage before it ({fix})")


def check_tiled_patches(embedding: nn.Module, grid: TileGrid, image_size: int | tuple[int, int],
                        what: str = "the ViT") -> None:
    """ConfigError (``--image-size``, naming sizes that work) when ``grid``'s tiles of an ``image_size`` image would
    cut one of the embedding's patches (a hybrid's: its stem's stride)."""
    from ..spatial.tokens.tiles import check_patch_grid

    size = (image_size, image_size) if isinstance(image_size, int) else image_size
    patch = patch_multiple(embedding)
    try:
        check_patch_grid(grid, size, (patch, patch), what)
    except ConfigError as refusal:
        raise ConfigError("--image-size", refusal.detail) from None


def embedded_prefix(embed: TokenEmbedding) -> int:
    """How many prefix tokens (class, registers) have a position embedding of their own (none: no_embed_class)."""
    count = embed.settings.get("num_prefix_tokens", 1)
    return 0 if embed.settings.get("no_embed_class") else (count if isinstance(count, int) else 1)


def resampled_positions(layers: Sequence[nn.Module], weights: Mapping[str, torch.Tensor],
                        source: str = "--weights") -> tuple[dict[str, torch.Tensor], str | None]:
    """``weights`` with a cut ViT's ``pos_embed`` resampled to the model's token grid as timm resamples it (bicubic,
    antialiased, prefix tokens kept) when the file's grid differs, and the line saying so (None: nothing to do)."""
    found = dict(weights)
    if not is_cut_vit(layers) or not isinstance(layers[0], TokenEmbedding):
        return found, None
    mine, theirs = getattr(layers[0], "pos_embed", None), found.get("pos_embed")
    if not isinstance(mine, torch.Tensor) or theirs is None or theirs.shape == mine.shape or theirs.dim() != 3:
        return found, None
    embed = layers[0]
    prefix = embedded_prefix(embed)
    side = math.isqrt(theirs.shape[1] - prefix)
    rows, cols = patch_grid_of(embed)
    if side * side != theirs.shape[1] - prefix or theirs.shape[2] != mine.shape[2]:
        return found, None          # not a square grid of the same width: load_weights names the shapes
    from timm.layers import resample_abs_pos_embed

    found["pos_embed"] = resample_abs_pos_embed(theirs, new_size=[rows, cols], old_size=[side, side],
                                                num_prefix_tokens=prefix)
    return found, (f"{source}: pos_embed holds a {side}x{side} token grid, the model {rows}x{cols} (--image-size): "
                   f"resampled as timm does (bicubic, antialiased; {prefix} prefix tokens kept)")
