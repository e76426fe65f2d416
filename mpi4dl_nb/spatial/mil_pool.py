"""Softmax-weighted pooling over the whole image on tiles (attention-MIL): exact merge across tiles and its adjoint.
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

from typing import Protocol

import torch
from torch.overrides import handle_torch_function, has_torch_function

from .function_ctx import FunctionContext
from .guard import DECLINED, OpFamilyHandlers, SpatialGuard
from .layer import SpatialRuntime, guard_runtime
from .ops import OpKind, TorchOp
from .reductions import tile_slots
from .tile_marks import is_tiled, layout_of


def softmax_pool(h: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``sum_i softmax(scores)_i h_i`` over every position of ``h`` (N, C, H, W) with ``scores`` (N, 1, H, W):
    (N, C). On tiles of a spatialized model the op guard computes it over the whole image."""
    if has_torch_function((h, scores)):
        result: torch.Tensor = handle_torch_function(softmax_pool, (h, scores), h, scores)
        return result
    weights = torch.softmax(scores.flatten(2), -1)
    return (h.flatten(2) * weights).sum(-1)


def _working(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least float32 (bf16/fp16 tiles merge their exponentials in float32, as autocast's softmax)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


class _PoolCtx(FunctionContext, Protocol):
    dtype: torch.dtype


class _TiledSoftmaxPool(torch.autograd.Function):
    """``softmax_pool`` of the whole image from each tile's part; backward is the exact adjoint."""

    @staticmethod
    def forward(fctx: _PoolCtx, h: torch.Tensor, scores: torch.Tensor, runtime: SpatialRuntime) -> torch.Tensor:
        features, logits = _working(h.detach()).flatten(2), _working(scores.detach()).flatten(2)
        peak = logits.amax(-1)                                    # (N, 1): this tile's running maximum
        weights = torch.exp(logits - peak[..., None])             # (N, 1, n)
        local = torch.cat([peak, weights.sum(-1), (features * weights).sum(-1)], 1)   # (N, 2 + C)
        slots = tile_slots(local.contiguous(), runtime)            # (tiles, N, 2 + C), tile order
        top = slots[:, :, 0].amax(0)                              # (N,)
        scale = torch.exp(slots[:, :, 0] - top)                   # (tiles, N)
        total = (slots[:, :, 1] * scale).sum(0)                   # (N,)
        pooled = (slots[:, :, 2:] * scale[..., None]).sum(0) / total[:, None]
        fctx.dtype = h.dtype
        fctx.save_for_backward(h, scores, top, total, pooled)
        return pooled   # in the working dtype: float32 for bf16/fp16 features, as softmax's float32 weights make it

    @staticmethod
    def backward(fctx: _PoolCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, scores, top, total, pooled = fctx.saved_tensors
        g = grad[..., None, None]                                      # (N, C, 1, 1)
        attention = torch.exp(_working(scores) - top[:, None, None, None]) / total[:, None, None, None]
        grad_h = attention * g
        along = (g * _working(h)).sum(1, keepdim=True) - (g[..., 0, 0] * pooled).sum(1)[:, None, None, None]
        return grad_h.to(fctx.dtype), (attention * along).to(scores.dtype), None


def softmax_pool_on_tiles(guard: SpatialGuard, func: TorchOp, args: tuple[object, ...],
                  kwargs: dict[str, object]) -> object:
    """The guard's handler of ``softmax_pool`` on tiles: the whole image's pooled vector on every tile."""
    if func is not softmax_pool:
        return DECLINED
    h, scores = (*args, *kwargs.values())[:2]
    if not (isinstance(h, torch.Tensor) and isinstance(scores, torch.Tensor)):
        return DECLINED
    if not (is_tiled(h) and is_tiled(scores)):
        raise guard.error(func, "pools a tile with replicated scores or features; compute the attention "
                          "scores from the tile itself (per pixel) so both are tiles")
    if not (layout_of(h).standard and layout_of(scores).standard and h.dim() == 4 and scores.dim() == 4):
        raise guard.error(func, "needs (N, C, H, W) tiles with the image's rows and columns last")
    runtime = guard_runtime(guard, "attention pooling")
    result: torch.Tensor = _TiledSoftmaxPool.apply(h, scores, runtime)
    return result


# softmax_pool's kind and the guard's handler of it (listed in families.OP_FAMILIES)
OP_FAMILY = OpFamilyHandlers(
    tiled={OpKind.POOLING: softmax_pool_on_tiles}, ops={softmax_pool: OpKind.POOLING})
