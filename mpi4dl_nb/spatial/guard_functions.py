"""The guard's autograd identities: a replicated operand's gradient summed over the tile group, or a share of it."""

from __future__ import annotations

from typing import Protocol

import torch

from ..comm.handles import Group
from ..comm.protocol import Comm
from .function_ctx import FunctionContext
from .reduce import GroupSumCtx


class SumGradOverTiles(torch.autograd.Function):
    """Identity whose backward sums the gradient over the tile group (a replicated operand of a tile op)."""

    @staticmethod
    def forward(fctx: GroupSumCtx, x: torch.Tensor, comm: Comm, group: Group | None) -> torch.Tensor:
        fctx.comm, fctx.group = comm, group
        return x.view_as(x)

    @staticmethod
    def backward(fctx: GroupSumCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = grad.detach().clone(memory_format=torch.contiguous_format)
        return fctx.comm.all_reduce(out, group=fctx.group), None, None


class ShareOfTiles(torch.autograd.Function):
    """Identity whose backward divides the gradient by the tile count: a parameter whose gradient is
    summed over the tiles at the end, used on a replicated tensor (every tile computes the same full
    gradient there; the sum then counts it once)."""

    @staticmethod
    def forward(fctx: _SharesCtx, x: torch.Tensor, tiles: int) -> torch.Tensor:
        fctx.tiles = tiles
        return x.view_as(x)

    @staticmethod
    def backward(fctx: _SharesCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad / fctx.tiles, None


class _SharesCtx(FunctionContext, Protocol):
    tiles: int
