"""Position embeddings of a ViT on token tiles: absolute and rotary ones of the global token grid, sliced."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from ...comm.handles import Group
from ...comm.protocol import Comm
from ..function_ctx import FunctionContext
from .tiles import TokenTiles, int_pair


def _tensor_attr(model: nn.Module, name: str) -> torch.Tensor | None:
    value = getattr(model, name, None)
    return value if isinstance(value, torch.Tensor) else None


def built_grid(model: nn.Module) -> tuple[int, int]:
    """The token grid the model was built for (its patch embedding's ``grid_size``)."""
    return int_pair(model.get_submodule("patch_embed").grid_size)


def _resampled(model: nn.Module, pos_embed: torch.Tensor, token_grid: tuple[int, int]) -> torch.Tensor:
    """``pos_embed`` for ``token_grid`` exactly as timm's ``_pos_embed`` resamples it (dynamic_img_size models)."""
    from timm.layers import resample_abs_pos_embed

    prefix = 0 if getattr(model, "no_embed_class", False) else int(getattr(model, "num_prefix_tokens", 0))
    old = built_grid(model)
    resampled: torch.Tensor = resample_abs_pos_embed(pos_embed, new_size=list(token_grid), old_size=list(old),
                                                     num_prefix_tokens=prefix)
    return resampled


def prefix_tokens(model: nn.Module, batch: int) -> list[torch.Tensor]:
    """The model's class token, then its register tokens, expanded to the batch (as timm orders them)."""
    return [token.expand(batch, -1, -1) for token in
            (_tensor_attr(model, "cls_token"), _tensor_attr(model, "reg_token")) if token is not None]


class _ShapesCtx(FunctionContext, Protocol):
    shapes: list[torch.Size]


class _ZeroGradients(torch.autograd.Function):
    """Identity on ``tokens`` whose backward gives ``parameters`` a zero gradient: the prefix tokens on tiles that do
    not hold them, so every tile sums the same list of gradients (``reduce_tile_gradients``)."""

    @staticmethod
    def forward(fctx: _ShapesCtx, tokens: torch.Tensor, *parameters: torch.Tensor) -> torch.Tensor:
        fctx.shapes = [p.shape for p in parameters]
        return tokens.view_as(tokens)

    @staticmethod
    def backward(fctx: _ShapesCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (grad, *(grad.new_zeros(shape) for shape in fctx.shapes))


class _TotalOnFirstCtx(FunctionContext, Protocol):
    comm: Comm
    group: Group | None
    first: bool


class _TotalOnFirst(torch.autograd.Function):
    """Identity whose backward sums the tiles' gradients and hands the total to tile 0 (zeros elsewhere): what a
    resampled (or learned rotary) embedding's gradient passes before timm's backward of it (which may round in
    float32), so that backward runs once on the whole gradient, as in one process."""

    @staticmethod
    def forward(fctx: _TotalOnFirstCtx, x: torch.Tensor, comm: Comm, group: Group | None, first: bool) -> torch.Tensor:
        fctx.comm, fctx.group, fctx.first = comm, group, first
        return x.view_as(x)

    @staticmethod
    def backward(fctx: _TotalOnFirstCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        total = fctx.comm.all_reduce(grad.detach().clone(memory_format=torch.contiguous_format), group=fctx.group)
        return (total if fctx.first else torch.zeros_like(total)), None, None, None


def add_positions(model: nn.Module, tokens: torch.Tensor, tiles: TokenTiles, comm: Comm,
                  group: Group | None) -> torch.Tensor:
    """timm's ``_pos_embed`` on a tile: this tile's image tokens plus their slice of the global grid's absolute
    position embedding, with the prefix tokens (and their embeddings) in front on tile 0."""
    pos_embed = _tensor_attr(model, "pos_embed")
    prefix = prefix_tokens(model, tokens.shape[0]) if tiles.prefix_here else []
    if not tiles.prefix_here and tiles.num_prefix and torch.is_grad_enabled():
        held = [t for t in (_tensor_attr(model, "cls_token"), _tensor_attr(model, "reg_token"))
                if t is not None and t.requires_grad]
        tokens = _ZeroGradients.apply(tokens, *held) if held else tokens
    if pos_embed is None:
        return torch.cat([*prefix, tokens], dim=1) if prefix else tokens
    if getattr(model, "dynamic_img_size", False) and tiles.token_grid != built_grid(model):
        pos_embed = _resampled(model, pos_embed, tiles.token_grid)
        if tiles.grid.num_tiles > 1 and pos_embed.requires_grad:
            pos_embed = _TotalOnFirst.apply(pos_embed, comm, group, tiles.tile == 0)
    with_prefix = not getattr(model, "no_embed_class", False)
    skip = tiles.num_prefix if with_prefix else 0
    index = torch.tensor(tiles.token_indices(), device=tokens.device)
    own = pos_embed[:, skip:].index_select(1, index)
    if not with_prefix:   # deit-3 / big-vision: embeddings for image tokens only, added before the prefix
        tokens = tokens + own
        return torch.cat([*prefix, tokens], dim=1) if prefix else tokens
    if prefix:
        return torch.cat([*prefix, tokens], dim=1) + torch.cat([pos_embed[:, :skip], own], dim=1)
    return tokens + own


def tile_rope(model: nn.Module, tiles: TokenTiles, comm: Comm, group: Group | None) -> torch.Tensor | None:
    """The model's rotary embedding for the global token grid (as its ``_pos_embed`` makes it), this tile's tokens;
    a learned one's gradient summed over the tiles before the rope's own backward (which may round in float32)."""
    rope = getattr(model, "rope", None)
    if rope is None:
        return None
    if getattr(model, "dynamic_img_size", False):
        full = rope.get_embed(shape=list(tiles.token_grid))
    elif hasattr(rope, "feat_shape"):
        full = rope.get_embed()
    else:
        full = rope.get_embed(shape=list(built_grid(model)))
    if not isinstance(full, torch.Tensor):
        raise TypeError(f"{type(rope).__name__}.get_embed gave {type(full).__name__}, not a tensor")
    if full.requires_grad and tiles.grid.num_tiles > 1:
        full = _TotalOnFirst.apply(full, comm, group, tiles.tile == 0)
    index = torch.tensor(tiles.token_indices(), device=full.device)
    return full.index_select(-2, index)
