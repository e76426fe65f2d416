"""Blockwise attention in one process: keys taken ``block`` at a time with ring attention's merge and backward (never
an n x n matrix) — the one-process memory baseline ring attention is measured against."""

from __future__ import annotations

from typing import Protocol

import torch

from ...errors import ConfigError
from ..function_ctx import FunctionContext
from .blocks import (
    BlockKernel,
    SoftmaxMerge,
    backward_operands,
    block_kernel,
    check_attention_inputs,
    default_scale,
    merge_dtype,
)


class _BlockwiseCtx(FunctionContext, Protocol):
    block: int
    scale: float
    kernel: BlockKernel


def _starts(keys: int, block: int) -> range:
    return range(0, keys, block)


class _Blockwise(torch.autograd.Function):
    """Attention merged block by block; backward recomputes each block's scores from the saved lse."""

    @staticmethod
    def forward(fctx: _BlockwiseCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, scale: float,
                kernel: BlockKernel) -> torch.Tensor:
        merge = SoftmaxMerge()
        for start in _starts(k.shape[-2], block):
            merge.add(*kernel.forward(q, k[..., start:start + block, :], v[..., start:start + block, :], scale))
        merged, lse = merge.result()
        out = merged.to(q.dtype)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.block, fctx.scale, fctx.kernel = block, scale, kernel
        return out

    @staticmethod
    def backward(fctx: _BlockwiseCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = fctx.saved_tensors
        block, scale, kernel = fctx.block, fctx.scale, fctx.kernel
        grad, out, delta = backward_operands(kernel, grad, out)    # once, not per block
        dtype = merge_dtype(q.dtype)
        dq = torch.zeros_like(q, dtype=dtype)
        dk, dv = torch.empty_like(k, dtype=dtype), torch.empty_like(v, dtype=dtype)
        for start in _starts(k.shape[-2], block):
            keys = slice(start, start + block)
            dq_block, dk[..., keys, :], dv[..., keys, :] = kernel.backward(
                grad, q, k[..., keys, :], v[..., keys, :], out, lse, delta, scale)
            dq.add_(dq_block)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, scale: float | None = None,
                        *, kernel: BlockKernel | None = None) -> torch.Tensor:
    """``softmax(q k^T scale) v`` in one process, the keys taken ``block`` at a time with the running log-sum-exp
    merge (ring attention's, without messages); differentiable in q, k and v, never an n_q x n_k matrix."""
    check_attention_inputs(q, k, v)
    if block < 1:
        raise ConfigError("block", f"{block}: take at least one key per block")
    chosen = block_kernel(q) if kernel is None else kernel
    out: torch.Tensor = _Blockwise.apply(q, k, v, block, default_scale(q) if scale is None else scale, chosen)
    return out
