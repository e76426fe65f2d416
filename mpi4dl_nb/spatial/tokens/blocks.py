"""Attention over one key/value block at a time: the block kernels (plain matmul, or fused kernels that return the
log-sum-exp), and the running log-sum-exp merge of partial results (what ring and blockwise attention share).
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ...errors import ConfigError

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
HALF_DTYPES = (torch.float16, torch.bfloat16)
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def merge_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results merge and gradients accumulate in: float32 for bf16/fp16, else the input's."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


def default_scale(q: torch.Tensor) -> float:
    return float(q.shape[-1]) ** -0.5


class BlockKernel(Protocol):
    """Attention of the queries over one key/value block, and that block's share of the gradients."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(o_b, lse_b)``: the block's normalised output (B, H, n_q, D) and log-sum-exp (B, H, n_q), merge dtype."""
        ...

    def backward(self, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, delta: torch.Tensor, scale: float) -> Grads:
        """The block's (dq share, dk, dv), merge dtype, given the whole attention's ``out``, ``lse`` and ``delta``."""
        ...


class PlainBlocks:
    """Block attention by matmuls in the merge dtype (float64, and where no fused kernel gives the lse)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = merge_dtype(q.dtype)
        k_t, v = k.to(dtype).transpose(-2, -1), v.to(dtype)
        outs, lses = [], []
        for rows in query_chunks(q, k.shape[-2]):
            scores = torch.matmul(q[..., rows, :].to(dtype), k_t).mul_(scale)
            lse = torch.logsumexp(scores, -1)
            outs.append(torch.matmul(scores.sub_(lse.unsqueeze(-1)).exp_(), v))
            lses.append(lse)
        return torch.cat(outs, -2), torch.cat(lses, -1)

    def backward(self, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, delta: torch.Tensor, scale: float) -> Grads:
        dtype = merge_dtype(q.dtype)
        q, k, v, grad = q.to(dtype), k.to(dtype), v.to(dtype), grad.to(dtype)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows in query_chunks(q, k.shape[-2]):
            q_rows, grad_rows = q[..., rows, :], grad[..., rows, :]
            probabilities = torch.matmul(q_rows, k.transpose(-2, -1)).mul_(scale)
            probabilities.sub_(lse[..., rows].unsqueeze(-1)).exp_()
            dv.add_(torch.matmul(probabilities.transpose(-2, -1), grad_rows))
            d_scores = torch.matmul(grad_rows, v.transpose(-2, -1)).sub_(delta[..., rows].unsqueeze(-1))
            d_scores.mul_(probabilities)
            del probabilities
            dq[..., rows, :] = torch.matmul(d_scores, k).mul_(scale)
            dk.add_(torch.matmul(d_scores.transpose(-2, -1), q_rows).mul_(scale))
        return dq, dk, dv


SCORE_CHUNK = 1 << 20    # the most scores one matmul of the plain path makes (8 MiB in float64): a kernel's tile


def query_chunks(q: torch.Tensor, keys: int) -> list[slice]:
    """Slices of the queries whose score blocks ``(B, H, rows, keys)`` hold at most ``SCORE_CHUNK`` scores (at
    least one row each): the plain path's transient is bounded whatever the token count, as a fused kernel's tiles
    are, so neither one process's blockwise attention nor a ring member's makes an N x N matrix."""
    per_row = max(1, q.shape[:-2].numel() * keys)
    rows, count = max(1, SCORE_CHUNK // per_row), q.shape[-2]
    return [slice(start, min(start + rows, count)) for start in range(0, count, rows)] or [slice(0, 0)]


FusedForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
FusedBackward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                         Grads]


@dataclass(frozen=True)
class FusedOps:
    """A fused attention kernel pair that returns (and takes back) the log-sum-exp; its lse may be padded along
    the queries (the memory-efficient CUDA kernel pads to a multiple of 32)."""

    name: str
    forward: FusedForward        # (q, k, v, scale) -> (out, lse as the kernel pads it)
    backward: FusedBackward      # (grad, q, k, v, out, lse as forward padded it, scale) -> (dq, dk, dv)
    strided: bool = False        # its backward takes grad and out at any strides (else: made contiguous)


def _efficient_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, _seed, _offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, False, scale=scale)
    return out, lse


def _efficient_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, scale: float) -> Grads:
    no_dropout = torch.zeros((), dtype=torch.int64)     # philox seed/offset: unused without dropout
    dq, dk, dv, _bias = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, None, out, lse, no_dropout, no_dropout, 0.0, [True, True, True, False], False, scale=scale)
    return dq, dk, dv


def _cpu_flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
    return out, lse


def _cpu_flash_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, scale: float) -> Grads:
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, False, scale=scale)
    return dq, dk, dv


CUDA_EFFICIENT = FusedOps("memory-efficient SDPA (CUDA)", _efficient_forward, _efficient_backward)
CPU_FLASH = FusedOps("flash SDPA for CPU", _cpu_flash_forward, _cpu_flash_backward, strided=True)


class FusedBlocks:
    """Block attention by a fused SDPA-class kernel that returns the lse; the merge stays in the merge dtype."""

    def __init__(self, ops: FusedOps) -> None:
        self.ops = ops
        self.lse_length: int | None = None    # the queries' length of the kernel's (padded) lse

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        if _empty(q, k):
            return PlainBlocks().forward(q, k, v, scale)
        out, lse = self.ops.forward(q, k, v, scale)
        self.lse_length = lse.shape[-1]
        dtype = merge_dtype(q.dtype)
        return out.to(dtype), lse[..., :q.shape[-2]].to(dtype)

    def backward(self, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, delta: torch.Tensor, scale: float) -> Grads:
        if _empty(q, k):     # the kernel's delta (``delta`` may be a placeholder: ``backward_operands``)
            return PlainBlocks().backward(grad, q, k, v, out, lse, output_delta(grad, out), scale)
        grad, out = self.backward_layout(grad.to(q.dtype), out.to(q.dtype))
        dq, dk, dv = self.ops.backward(grad, q, k, v, out, self._padded(lse), scale)
        dtype = merge_dtype(q.dtype)
        return dq.to(dtype), dk.to(dtype), dv.to(dtype)

    def backward_layout(self, grad: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``grad`` and ``out`` in a layout the kernel's backward takes: as they are where it takes any strides
        (torch's CPU flash kernel, results the same at any strides), else contiguous (no copy once contiguous)."""
        return (grad, out) if self.ops.strided else (grad.contiguous(), out.contiguous())

    def _padded(self, lse: torch.Tensor) -> torch.Tensor:
        """``lse`` (B, H, n_q) in the kernel's layout: float32 on CUDA, padded along the queries as it returned it."""
        dtype = torch.float32 if lse.dtype in HALF_DTYPES else lse.dtype
        length = lse.shape[-1] if self.lse_length is None else self.lse_length
        if length == lse.shape[-1] and dtype == lse.dtype:
            return lse                     # the CPU kernel's lse is not padded: no copy per block
        padded = lse.new_zeros((*lse.shape[:-1], length), dtype=dtype)
        padded[..., :lse.shape[-1]] = lse
        return padded


def _empty(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the block has no queries, keys, batch, heads or head size (torch's CPU flash kernel dies of a
    floating point exception on some of these: they take the plain path, which makes empty results)."""
    return q.numel() == 0 or k.numel() == 0


def block_kernel(q: torch.Tensor) -> BlockKernel:
    """The fused kernel where one returns the lse for these tensors, else the plain matmul path: on CUDA the
    memory-efficient kernel (fp16/bf16/fp32, a head size of a multiple of 8, memory-efficient SDPA enabled), on
    CPU the flash kernel for CPU (fp16/bf16/fp32, any head size, flash SDPA enabled: torch's switch for CPU
    too); float64 always takes the plain path (its results stay the matmuls', exact up to summation order).
    On ``meta`` (the planner's shape-only simulation of a ring member) as on CPU: the fused kernels keep no
    score block, so the plain path's transient would be planned for a run that never makes it."""
    if q.dtype not in FUSED_DTYPES:
        return PlainBlocks()
    if q.device.type == "cuda" and q.shape[-1] % 8 == 0 and torch.backends.cuda.mem_efficient_sdp_enabled():
        return FusedBlocks(CUDA_EFFICIENT)
    if q.device.type in ("cpu", "meta") and torch.backends.cuda.flash_sdp_enabled():
        return FusedBlocks(CPU_FLASH)
    return PlainBlocks()


class SoftmaxMerge:
    """The running merge of block results: output and log-sum-exp over the blocks added so far."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        if self.out is None or self.lse is None:
            self.out, self.lse = out, lse
            return
        merged = torch.logaddexp(self.lse, lse)
        self.out = self.out.mul_(torch.exp(self.lse - merged).unsqueeze(-1))
        self.out.add_(out.mul_(torch.exp(lse - merged).unsqueeze(-1)))
        self.lse = merged

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.out is None or self.lse is None:
            raise ValueError("no key/value block was merged")
        return self.out, self.lse


def backward_operands(kernel: BlockKernel, grad: torch.Tensor,
                      out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad, out, delta)`` for ``kernel``'s backward of every block, made once per attention, not per block. A
    fused kernel computes ``delta`` from ``grad`` and ``out`` itself (here an empty placeholder: nothing to compute)
    and takes them in its own layout (``FusedBlocks.backward_layout``: a timm attention's transposed dO and the kernel's
    output need no copy where it takes any strides); another kernel gets ``grad`` contiguous and ``delta``."""
    if isinstance(kernel, FusedBlocks):
        grad, out = kernel.backward_layout(grad, out)
        return grad, out, grad.new_empty(0)
    grad = grad.contiguous()
    return grad, out, output_delta(grad, out)


def output_delta(grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``rowsum(dO * O)`` (B, H, n_q) in the merge dtype: the softmax backward's per-query term."""
    dtype = merge_dtype(out.dtype)
    return (grad.to(dtype) * out.to(dtype)).sum(-1)


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """ConfigError naming what is wrong unless q (B, H, n_q, D), k and v (B, H, n_k, D) fit each other."""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ConfigError("attention inputs", f"{shapes}: give (batch, heads, tokens, head_dim) tensors")
    if k.shape != v.shape:
        raise ConfigError("attention inputs", f"{shapes}: keys and values must have the same shape")
    if (q.shape[0], q.shape[1], q.shape[3]) != (k.shape[0], k.shape[1], k.shape[3]):
        raise ConfigError("attention inputs", f"{shapes}: queries and keys must agree in batch, heads and head_dim")
    if len({q.dtype, k.dtype, v.dtype}) > 1 or len({q.device, k.device, v.device}) > 1:
        raise ConfigError("attention inputs", f"dtypes {q.dtype}, {k.dtype}, {v.dtype} on {q.device}, {k.device}, "
                                              f"{v.device}: give q, k and v one dtype on one device")
