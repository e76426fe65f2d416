"""Scatter a full image into tiles and gather tiles back, both autograd-aware.

Semantics (replicated consumer): the full tensor lives, identical, on every rank of the tile
group. ``scatter_tiles`` hands each rank its tile; its backward all-gathers the tile
gradients so every rank's full-tensor gradient is complete. ``gather_tiles`` rebuilds the
full tensor on every rank; its backward assumes every rank computed the same downstream
loss from it (so holds the same full gradient) and gives each tile its slice, no message.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import EllipsisType
from typing import Protocol

import torch

from ..comm.handles import Group
from ..comm.protocol import Comm
from .function_ctx import FunctionContext
from .geometry import Range, TileGrid

Extent = tuple[Range, ...]   # a tile's range along every tiled axis


def tile_ranks(grid: TileGrid, ctx: Comm, group: Group | None = None) -> tuple[list[int], int]:
    """Global rank of every tile and this rank's tile; ``group=None`` means the world."""
    ranks = list(group.ranks) if group is not None else list(range(ctx.world_size))
    if len(ranks) != grid.num_tiles:
        what = "group" if group is not None else "world"
        raise ValueError(f"{grid} has {grid.num_tiles} tiles but the {what} has {len(ranks)} "
                         f"ranks; pass group=ctx.new_group(<{grid.num_tiles} ranks>) or run with "
                         f"{grid.num_tiles} ranks")
    if ctx.rank not in ranks:
        raise ValueError(f"rank {ctx.rank} holds no tile of group {ranks}")
    return ranks, ranks.index(ctx.rank)


def _box_slice(extent: Extent) -> tuple[EllipsisType | slice, ...]:
    return (Ellipsis, *(slice(start, stop) for start, stop in extent))


def _assemble(tile: torch.Tensor, boxes: Sequence[Extent], mine: int, full_shape: Sequence[int],
              ctx: Comm, group: Group | None) -> torch.Tensor:
    """Full tensor on every rank: own tile placed into zeros, then an all-reduce sum."""
    full = tile.new_zeros(tuple(full_shape))
    full[_box_slice(boxes[mine])] = tile
    ctx.all_reduce(full, group=group)
    return full


class _ScatterCtx(FunctionContext, Protocol):
    args: tuple[list[Extent], int, Comm, Group | None, tuple[int, ...]]   # boxes, mine, comm, group, full shape


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(fctx: _ScatterCtx, x: torch.Tensor, boxes: list[Extent], mine: int, comm: Comm,
                group: Group | None) -> torch.Tensor:
        fctx.args = (boxes, mine, comm, group, tuple(x.shape))
        return x[_box_slice(boxes[mine])].contiguous()

    @staticmethod
    def backward(fctx: _ScatterCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        boxes, mine, comm, group, shape = fctx.args
        full = _assemble(grad.contiguous(), boxes, mine, shape, comm, group)
        return full, None, None, None, None


class _GatherCtx(FunctionContext, Protocol):
    box: Extent


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(fctx: _GatherCtx, tile: torch.Tensor, boxes: list[Extent], mine: int, comm: Comm,
                group: Group | None, full_shape: tuple[int, ...]) -> torch.Tensor:
        fctx.box = boxes[mine]
        return _assemble(tile.contiguous(), boxes, mine, full_shape, comm, group)

    @staticmethod
    def backward(fctx: _GatherCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad[_box_slice(fctx.box)].contiguous(), None, None, None, None, None


def scatter_tiles(x: torch.Tensor, grid: TileGrid, ctx: Comm, group: Group | None = None) -> torch.Tensor:
    """This rank's tile of ``x`` (``(..., H, W)``, a volume grid's ``(..., D, H, W)``; identical on
    every rank of the group)."""
    ranks, mine = tile_ranks(grid, ctx, group)
    sizes = tuple(x.shape[-grid.ndim:])
    grid.check_sizes(sizes)
    boxes = grid.extents(sizes)
    if len(ranks) == 1:
        return x
    return _Scatter.apply(x, boxes, mine, ctx, group)


def gather_tiles(tile: torch.Tensor, grid: TileGrid, ctx: Comm, group: Group | None = None,
                 full_shape: Sequence[int] | None = None) -> torch.Tensor:
    """The full tensor on every rank of the group, from each rank's owned ``tile``.

    ``full_shape`` (``(..., H, W)``; a volume grid's ``(..., D, H, W)``) spares one small object
    all-gather to learn the sizes.
    """
    ranks, mine = tile_ranks(grid, ctx, group)
    if len(ranks) == 1:
        return tile
    axes = grid.ndim
    if full_shape is None:
        sizes = ctx.all_gather_object(tuple(tile.shape[-axes:]), group=group)
        full_shape = (*tile.shape[:-axes], *grid.full_lengths(sizes))
    full_shape = tuple(int(s) for s in full_shape)
    boxes = grid.extents(full_shape[-axes:])
    owned = tuple(stop - start for start, stop in boxes[mine])
    if tuple(tile.shape[-axes:]) != owned:
        raise ValueError(f"gather_tiles: tile {mine} has spatial shape {tuple(tile.shape[-axes:])}, "
                         f"but owns {owned} of {full_shape[-axes:]} under {grid}")
    return _Gather.apply(tile, boxes, mine, ctx, group, full_shape)
