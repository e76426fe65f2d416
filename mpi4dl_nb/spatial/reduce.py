"""Differentiable sums over the tile group: partitioned consumers (BatchNorm) and replicated ones (pooling)."""

from __future__ import annotations

from typing import Protocol

import torch

from ..comm.handles import Group
from ..comm.protocol import Comm
from .function_ctx import FunctionContext


class GroupSumCtx(FunctionContext, Protocol):
    """The context of a sum over a group whose backward sums again."""

    comm: Comm
    group: Group | None


class _SumPartitioned(torch.autograd.Function):
    """All-reduce sum whose result each tile uses for its own part: backward all-reduces."""

    @staticmethod
    def forward(fctx: GroupSumCtx, x: torch.Tensor, comm: Comm, group: Group | None) -> torch.Tensor:
        fctx.comm, fctx.group = comm, group
        return comm.all_reduce(x.detach().clone(memory_format=torch.contiguous_format), group=group)

    @staticmethod
    def backward(fctx: GroupSumCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = grad.detach().clone(memory_format=torch.contiguous_format)
        return fctx.comm.all_reduce(out, group=fctx.group), None, None


class _SumReplicated(torch.autograd.Function):
    """All-reduce sum consumed identically on every tile: backward passes the gradient on."""

    @staticmethod
    def forward(fctx: FunctionContext, x: torch.Tensor, comm: Comm, group: Group | None) -> torch.Tensor:
        return comm.all_reduce(x.detach().clone(memory_format=torch.contiguous_format), group=group)

    @staticmethod
    def backward(fctx: FunctionContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad, None, None


def partitioned_sum(x: torch.Tensor, comm: Comm, group: Group | None = None) -> torch.Tensor:
    """Sum of ``x`` over the group; gradients of all tiles' uses flow back to every tile."""
    return _SumPartitioned.apply(x, comm, group)


def replicated_sum(x: torch.Tensor, comm: Comm, group: Group | None = None) -> torch.Tensor:
    """Sum of ``x`` over the group, for a result every tile consumes identically."""
    return _SumReplicated.apply(x, comm, group)
