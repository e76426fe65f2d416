"""A 3-D Swin model's window blocks and patch merging on a volume's tiles (``models/swin3d.py``), exactly.

A window block's layer norms and MLP act on each token: they run on the tile's own tokens. Its token mixing (roll,
windows, attention, reverse) runs on the whole token grid: the normalised tokens are gathered from every tile
(``_Whole``: one all-reduce), every rank mixes the whole grid with the block's own ``mix`` and keeps its tile's part.
The backward of the gather sums every rank's gradient of the whole grid and gives each tile its part, so each token's
gradient is counted once; each parameter's gradient on a rank is its own tokens' share (summed over the tiles with the
spatial layers' shares). Patch merging runs on the tile itself where every tile starts and ends on even positions
(each 2x2x2 group then lies in one tile, and the halved tiles are the balanced split of the halved grid), else
on the gathered grid like the mixing.

The gathered path holds the stage's whole token grid on every rank and mixes every window on every rank: exact for
any grid, not 1/P in memory or compute. Blocks whose windows stay inside tiles can mix locally after a distributed
cyclic roll (issue 53's window exchange): not built here yet.
"""
from __future__ import annotations

from collections.abc import Callable
from types import EllipsisType
from typing import Protocol

import torch
from torch import nn

from ..comm.handles import Group
from ..comm.protocol import Comm
from ..errors import ConfigError
from .function_ctx import FunctionContext
from .layer import SpatialLayer, SpatialRuntime, adopt
from .registry import SPATIAL_LAYERS, Conversion

Extent = tuple[tuple[int, int], ...]


class WindowBlock(Protocol):
    """What a window block of ``models/swin3d.py`` offers its tile version: per-token parts and the whole-grid mix."""

    norm1: nn.Module
    norm2: nn.Module
    mlp: nn.Module

    def mix(self, tokens: torch.Tensor) -> torch.Tensor: ...


def _part(extent: Extent) -> tuple[EllipsisType | slice, ...]:
    """The index of ``extent``'s part of a ``(..., D, H, W)`` tensor."""
    return (Ellipsis, *(slice(start, stop) for start, stop in extent))


class _WholeCtx(FunctionContext, Protocol):
    args: tuple[Extent, Comm, Group | None]


class _Whole(torch.autograd.Function):
    """The whole ``(N, C, D, H, W)`` tensor on every rank from each rank's tile; backward: every rank's gradient of
    it summed, this tile's part (the ranks' consumers differ: each keeps its own part of what it computes)."""

    @staticmethod
    def forward(fctx: _WholeCtx, tile: torch.Tensor, extent: Extent, sizes: tuple[int, ...], comm: Comm,
                group: Group | None) -> torch.Tensor:
        fctx.args = (extent, comm, group)
        whole = tile.new_zeros((*tile.shape[:2], *sizes))
        whole[_part(extent)] = tile
        comm.all_reduce(whole, group=group)
        return whole

    @staticmethod
    def backward(fctx: _WholeCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        extent, comm, group = fctx.args
        summed = grad.contiguous().clone()
        comm.all_reduce(summed, group=group)
        return summed[_part(extent)].contiguous(), None, None, None, None


def on_whole(tile: torch.Tensor, sizes: tuple[int, ...], runtime: SpatialRuntime,
             compute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``compute`` of the whole ``(N, C, D, H, W)`` tensor whose tile here is ``tile`` (``sizes`` its whole D, H, W),
    this tile's part of its result (the balanced split of the result's D, H, W)."""
    whole = tile if len(runtime.ranks) == 1 else _Whole.apply(
        tile.contiguous(), runtime.grid.extent(runtime.tile, sizes), sizes, runtime.ctx, runtime.group)
    out = compute(whole)
    return out[_part(runtime.grid.extent(runtime.tile, tuple(out.shape[-3:])))]


class SpatialWindowBlock(SpatialLayer, nn.Module):
    """A (shifted) window block on a volume's tile: per-token parts on the tile, the mix on the gathered grid."""

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        block: WindowBlock = self   # type: ignore[assignment]   # bound to the model's block class
        sizes = self.runtime.axis_sizes(self, x)
        tokens = x.permute(0, 2, 3, 4, 1)
        normed = block.norm1(tokens).permute(0, 4, 1, 2, 3)
        mixed = on_whole(normed, sizes, self.runtime,
                         lambda whole: block.mix(whole.permute(0, 2, 3, 4, 1)).permute(0, 4, 1, 2, 3))
        tokens = tokens + mixed.permute(0, 2, 3, 4, 1)
        tokens = tokens + block.mlp(block.norm2(tokens))
        return tokens.permute(0, 4, 1, 2, 3)


class SpatialPatchMerge(SpatialLayer, nn.Module):
    """2x2x2 patch merging on a volume's tile: on the tile where every tile's range is even, else gathered."""

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        sizes = self.runtime.axis_sizes(self, x)
        if any(n % 2 for n in sizes):
            raise ConfigError("model", f"layer {self.layer_name!r} merges 2x2x2 tokens of a {sizes} grid: every side "
                                       f"must be even (choose --image-size sides divisible by the model's stride)")
        extents = self.runtime.grid.extents(sizes)
        merge = self.serial_class.forward
        if all(start % 2 == 0 and stop % 2 == 0 for extent in extents for start, stop in extent):
            return merge(self, x)
        return on_whole(x, sizes, self.runtime, lambda whole: merge(self, whole))


Convert = Callable[[nn.Module, SpatialRuntime, str], nn.Module]


def _converter(kind: type[SpatialWindowBlock] | type[SpatialPatchMerge]) -> Convert:
    def convert(module: nn.Module, runtime: SpatialRuntime, name: str) -> nn.Module:
        for parameter in module.parameters():   # each rank's gradient: its own tokens' share
            runtime.claim_tile_share(parameter)
        return adopt(kind, module, runtime, name)
    return convert


def register_swin3d(block: type[nn.Module], merge: type[nn.Module]) -> None:
    """Let ``spatialize`` convert a 3-D Swin model's ``block`` and ``merge`` classes on a volume's tiles."""
    SPATIAL_LAYERS[block] = Conversion(_converter(SpatialWindowBlock), 3)
    SPATIAL_LAYERS[merge] = Conversion(_converter(SpatialPatchMerge), 3)
