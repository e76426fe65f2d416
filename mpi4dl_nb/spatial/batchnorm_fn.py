"""BatchNorm over every tile (of an image or a volume) as one autograd Function that saves only its input.
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

from typing import Protocol

import torch

from ..comm.handles import Group
from ..comm.protocol import Comm
from .backward_half import input_gradient_wanted
from .function_ctx import FunctionContext
from .replay import active_log

LOW_PRECISION = (torch.bfloat16, torch.float16)


def _dims(t: torch.Tensor) -> tuple[int, ...]:
    """Every dim but the channels': batch and the spatial dims (2 for images, 3 for volumes)."""
    return (0, *range(2, t.dim()))


def _statistics(wide: torch.Tensor, count: float, comm: Comm, group: Group | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(centred tile, mean, biased var): from the active log's replay, else two all-reduces."""
    log = active_log()
    if log is not None and log.replaying:
        mean, var = log.next_statistics()
        return wide - _channels(mean, wide.dim()), mean, var
    mean = _all_reduce(wide.sum(dim=_dims(wide)), comm, group) / count
    centered = wide - _channels(mean, wide.dim())
    var = _all_reduce((centered * centered).sum(dim=_dims(wide)), comm, group) / count
    if log is not None:
        log.record((mean, var))
    return centered, mean, var


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype statistics accumulate in (float32 for low-precision tiles)."""
    return x.float() if x.dtype in LOW_PRECISION else x


def _channels(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """Per-channel ``t`` shaped to broadcast over an ``ndim``-dim tile."""
    return t.reshape(1, -1, *([1] * (ndim - 2)))


def _all_reduce(t: torch.Tensor, comm: Comm, group: Group | None) -> torch.Tensor:
    return comm.all_reduce(t.contiguous(), group=group)


class _TileBatchNormCtx(FunctionContext, Protocol):
    comm: Comm
    group: Group | None
    count: float
    bias_dtype: torch.dtype | None


class _TileBatchNorm(torch.autograd.Function):
    """Training-mode BatchNorm of a tile with statistics over the group; see the module docstring."""

    @staticmethod
    def forward(fctx: _TileBatchNormCtx, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                count: float, eps: float, comm: Comm, group: Group | None) -> tuple[torch.Tensor, ...]:
        centered, mean, var = _statistics(_wide(x), count, comm, group)
        rstd = torch.rsqrt(var + eps)
        y = centered.mul_(_channels(rstd, x.dim()))
        if weight is not None:
            y = y.mul_(_channels(weight.to(y.dtype), x.dim()))
        if bias is not None:
            y = y.add_(_channels(bias.to(y.dtype), x.dim()))
        fctx.comm, fctx.group, fctx.count = comm, group, count
        fctx.bias_dtype = bias.dtype if bias is not None else None
        fctx.save_for_backward(x, weight, mean, rstd)
        fctx.mark_non_differentiable(mean, var)
        return y.to(x.dtype), mean, var

    @staticmethod
    def backward(fctx: _TileBatchNormCtx, grad: torch.Tensor, *_: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, rstd = fctx.saved_tensors
        bias_dtype = fctx.bias_dtype
        wide = _wide(x)
        xhat = (wide - _channels(mean, wide.dim())).mul_(_channels(rstd, wide.dim()))
        g = grad.to(wide.dtype)
        sum_g = g.sum(dim=_dims(g))
        sum_g_xhat = (g * xhat).sum(dim=_dims(g))
        grad_weight = sum_g_xhat.to(weight.dtype) if weight is not None and fctx.needs_input_grad[1] else None
        grad_bias = sum_g.to(grad.dtype if bias_dtype is None else bias_dtype) if fctx.needs_input_grad[2] else None
        grad_x = None
        if input_gradient_wanted(fctx.needs_input_grad[0]):
            total = _all_reduce(torch.stack([sum_g, sum_g_xhat]), fctx.comm, fctx.group) / fctx.count
            scale = rstd * weight.to(rstd.dtype) if weight is not None else rstd
            ndim = g.dim()
            grad_x = (g - _channels(total[0], ndim) - xhat.mul_(_channels(total[1], ndim))).mul_(
                _channels(scale, ndim))
            grad_x = grad_x.to(x.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None


def tile_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, count: float,
                    eps: float, comm: Comm, group: Group | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normalised tile in ``x``'s dtype, batch mean, biased batch variance) over the group's ``count`` elements."""
    y, mean, var = _TileBatchNorm.apply(x, weight, bias, count, eps, comm, group)
    return y, mean, var
