"""Pools of a ViT's token tiles to one replicated vector per image: the class token, the mean of the image tokens."""

from __future__ import annotations

from typing import Protocol

import torch

from ...comm.handles import Group
from ...comm.protocol import Comm
from ..function_ctx import FunctionContext
from ..reduce import replicated_sum
from .tiles import TokenTiles


class _FirstTileCtx(FunctionContext, Protocol):
    first: bool


class _FirstTileValue(torch.autograd.Function):
    """Tile 0's ``value`` on every rank (bitwise: the others add zeros); backward: tile 0's only (every rank holds the
    same full gradient of a replicated result), zeros elsewhere (their graph kept, for the collectives in it)."""

    @staticmethod
    def forward(fctx: _FirstTileCtx, value: torch.Tensor, first: bool, comm: Comm, group: Group | None) -> torch.Tensor:
        fctx.first = first
        mine = value.detach().clone(memory_format=torch.contiguous_format) if first else torch.zeros_like(value)
        return comm.all_reduce(mine.contiguous(), group=group)

    @staticmethod
    def backward(fctx: _FirstTileCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (grad if fctx.first else torch.zeros_like(grad)), None, None, None


def first_tile_value(value: torch.Tensor, tiles: TokenTiles, comm: Comm, group: Group | None) -> torch.Tensor:
    """Tile 0's ``value`` (computed on every tile) as one replicated value, its gradient counted on tile 0 only."""
    if tiles.grid.num_tiles == 1:
        return value
    return _FirstTileValue.apply(value, tiles.tile == 0, comm, group)


def class_token(tokens: torch.Tensor, tiles: TokenTiles, comm: Comm, group: Group | None) -> torch.Tensor:
    """``x[:, 0]`` of the whole sequence (tile 0's first token), replicated on every rank: timm's 'token' pool."""
    return first_tile_value(tokens[:, 0], tiles, comm, group)


def mean_of_tokens(tokens: torch.Tensor, tiles: TokenTiles, comm: Comm, group: Group | None,
                   include_prefix: bool = False) -> torch.Tensor:
    """The mean over the image tokens (and the prefix tokens when ``include_prefix``) of the whole sequence,
    replicated on every rank: timm's 'avg' pool."""
    skip = 0 if include_prefix else tiles.prefix_here
    count = tiles.image_tokens + (tiles.num_prefix if include_prefix else 0)
    local = tokens[:, skip:].sum(dim=1)
    total = local if tiles.grid.num_tiles == 1 else replicated_sum(local, comm, group)
    return total / count
