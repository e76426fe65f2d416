"""Exact global attention across ranks: ring attention as an autograd Function (Liu, Zaharia, Abbeel 2023).
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch

from ...comm.handles import Group, Request, Transfer
from ...comm.protocol import Comm
from ...comm.tags import RING
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
from .ring_steps import RingSchedule, RingStep, RingTraffic, checked_counts, ring_traffic


@dataclass(frozen=True)
class Ring:
    """The ranks one attention spans: ``group``'s ranks in ring order (None: the world), and how many keys
    (tokens) each member holds, in ring order (member 0 may also hold class/register tokens); ``name`` labels its
    trace events (``layer``), e.g. the attention module's path."""

    comm: Comm
    group: Group | None
    key_counts: tuple[int, ...]
    name: str = ""

    @property
    def members(self) -> tuple[int, ...]:
        """The global ranks of the ring, in ring order."""
        return self.group.ranks if self.group is not None else tuple(range(self.comm.world_size))

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def position(self) -> int:
        """This rank's place in the ring (ConfigError if it is not a member)."""
        if self.comm.rank not in self.members:
            raise ConfigError("ring.group", f"rank {self.comm.rank} is not in the ring {list(self.members)}: call "
                                            "ring_attention on the ring's members only")
        return self.members.index(self.comm.rank)

    @property
    def schedule(self) -> RingSchedule:
        return RingSchedule(self.size, self.position)

    @property
    def total_keys(self) -> int:
        return sum(self.key_counts)

    def traffic(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype) -> RingTraffic:
        """The bytes this member sends per attention layer, forward and backward."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        gradient_itemsize = torch.empty((), dtype=merge_dtype(dtype)).element_size()
        per_key = batch * heads * head_dim
        return ring_traffic(self.key_counts, self.position, per_key * itemsize, per_key * gradient_itemsize)


class Pass(Enum):
    """Which pass a ring message belongs to, with its tag offset in RING."""

    FORWARD = "forward"
    BACKWARD = "backward"
    GRADIENT = "gradient"

    @property
    def tag(self) -> int:
        return RING.tag(list(Pass).index(self))


class RingLink:
    """This member's two links of the ring (to the next, from the previous member) and their trace events."""

    def __init__(self, ring: Ring) -> None:
        schedule = ring.schedule
        self.comm, self.group = ring.comm, ring.group
        self.next, self.prev = ring.members[schedule.next], ring.members[schedule.prev]
        self.tracer, self.layer = ring.comm.tracer, ring.name

    def post(self, send: Sequence[torch.Tensor], receive: Sequence[torch.Tensor], step: int, kind: Pass) -> Request:
        """Send the tensors ``send`` to the next member and receive ``receive`` from the previous one, in that order
        (one exchange)."""
        if self.tracer.enabled:
            now = self.tracer.stamp()
            self.tracer.record("ring_send", now, now, bytes=sum(t.numel() * t.element_size() for t in send),
                               peer=self.next, step=step, what=kind.value, layer=self.layer)
        tag = kind.tag
        return self.comm.exchange([*(Transfer.to(t, self.next, tag) for t in send),
                                   *(Transfer.into(t, self.prev, tag) for t in receive)], via=self.group)

    def wait(self, request: Request, step: int, kind: Pass) -> None:
        with self.tracer.span("ring_wait", peer=self.prev, step=step, what=kind.value, layer=self.layer):
            request.wait()

    def computing(self, step: int, kind: Pass) -> AbstractContextManager[object]:
        """The trace span of one block's compute."""
        return self.tracer.span("ring_block", step=step, what=kind.value, layer=self.layer)


def _block_shape(like: torch.Tensor, keys: int) -> tuple[int, ...]:
    """A packed (key, value) block of ``keys`` tokens: (2, B, H, keys, D)."""
    return (2, *like.shape[:2], keys, like.shape[-1])


class KeyValueTravel:
    """The key/value blocks a member computes with, in ring order: the next block's exchange is posted before the
    current block is handed out (its compute runs while the message flies)."""

    def __init__(self, ring: Ring, link: RingLink) -> None:
        self.schedule, self.counts, self.link = ring.schedule, ring.key_counts, link

    def blocks(self, k: torch.Tensor, v: torch.Tensor,
               kind: Pass) -> Iterator[tuple[RingStep, torch.Tensor, torch.Tensor]]:
        held: torch.Tensor | None = None
        pair = (k, v)
        for step in self.schedule.steps:
            request = incoming = None
            if step.arriving is not None:
                held = torch.stack((k, v)) if held is None else held
                incoming = held.new_empty(_block_shape(k, self.counts[step.arriving]))
                request = self.link.post((held,), (incoming,), step.step, kind)
            yield step, *pair
            if request is not None and incoming is not None:
                self.link.wait(request, step.step, kind)
                held, pair = incoming, (incoming[0], incoming[1])


def _carried(gradient: torch.Tensor) -> torch.Tensor:
    """A key/value gradient (B, H, keys, D) as its accumulator travels: (B, keys, H, D), contiguous. A fused
    kernel's gradients are laid out so (a view: no copy); another layout is copied once."""
    return gradient.transpose(1, 2).contiguous()


class GradientCarry:
    """Each block's dK/dV accumulator: a member keeps its own block's share; the accumulator of another member's
    block starts at the first member after its owner, travels one hop behind the block and arrives home after
    ``P - 1`` hops, where the owner adds its share (one hop fewer than sending the owner's share round the ring,
    and no wait at step 1: for ``P = 2`` the only wait is for the returning accumulator, after the last block).
    An accumulator travels as two messages, dK and dV (``_carried``'s layout), not stacked into one: no copy."""

    def __init__(self, ring: Ring, link: RingLink, like: torch.Tensor) -> None:
        self.schedule, self.counts, self.link = ring.schedule, ring.key_counts, link
        self.like = like
        self.pending: Request | None = None
        self.incoming: tuple[torch.Tensor, torch.Tensor] | None = None    # (dK, dV) as ``_carried`` lays them out
        self.own: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, step: RingStep, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Add this member's share of the held block's dK/dV, and pass the accumulator on (not the own block's)."""
        if step.step == 0:
            self.own = (dk, dv)
            return
        if self.pending is None or self.incoming is None:
            carried = (_carried(dk), _carried(dv))
        else:
            self.link.wait(self.pending, step.step - 1, Pass.GRADIENT)
            carried = self.incoming
            carried[0].transpose(1, 2).add_(dk)
            carried[1].transpose(1, 2).add_(dv)
        like, keys = self.like, self.counts[self.schedule.gradient_owner_arriving(step.step)]
        shape = (like.shape[0], keys, like.shape[1], like.shape[-1])
        self.incoming = (carried[0].new_empty(shape), carried[1].new_empty(shape))
        self.pending = self.link.post(carried, self.incoming, step.step, Pass.GRADIENT)

    def home(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This member's own dK/dV, summed over every member's queries (the others' shares, then its own)."""
        if self.own is None:
            raise RuntimeError("ring attention backward: the own block's gradient was not computed")
        if self.schedule.size == 1:
            return self.own
        if self.pending is None or self.incoming is None:
            raise RuntimeError("ring attention backward: no gradient was passed on")
        self.link.wait(self.pending, self.schedule.size - 1, Pass.GRADIENT)
        dk, dv = self.own
        return self.incoming[0].transpose(1, 2).add_(dk), self.incoming[1].transpose(1, 2).add_(dv)


class _RingCtx(FunctionContext, Protocol):
    ring: Ring
    scale: float
    kernel: BlockKernel


class _RingAttention(torch.autograd.Function):
    """Ring attention: forward merges the travelling blocks; backward sends the dK/dV accumulators around."""

    @staticmethod
    def forward(fctx: _RingCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, scale: float,
                kernel: BlockKernel) -> torch.Tensor:
        link = RingLink(ring)
        merge = SoftmaxMerge()
        for step, k_block, v_block in KeyValueTravel(ring, link).blocks(k, v, Pass.FORWARD):
            with link.computing(step.step, Pass.FORWARD):
                merge.add(*kernel.forward(q, k_block, v_block, scale))
        merged, lse = merge.result()
        out = merged.to(q.dtype)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.ring, fctx.scale, fctx.kernel = ring, scale, kernel
        return out

    @staticmethod
    def backward(fctx: _RingCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = fctx.saved_tensors
        ring, scale, kernel = fctx.ring, fctx.scale, fctx.kernel
        link = RingLink(ring)
        grad, out, delta = backward_operands(kernel, grad, out)    # once, not per block
        carry = GradientCarry(ring, link, k)
        dq: torch.Tensor | None = None
        for step, k_block, v_block in KeyValueTravel(ring, link).blocks(k, v, Pass.BACKWARD):
            with link.computing(step.step, Pass.BACKWARD):
                dq_block, dk_block, dv_block = kernel.backward(grad, q, k_block, v_block, out, lse, delta, scale)
            dq = dq_block if dq is None else dq.add_(dq_block)
            carry.add(step, dk_block, dv_block)
        dk, dv = carry.home()
        assert dq is not None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def check_ring_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> None:
    """ConfigError naming what is wrong when the tensors do not fit each other or the ring."""
    check_attention_inputs(q, k, v)
    counts = checked_counts(ring.key_counts, ring.size)
    position = ring.position
    if k.shape[-2] != counts[position]:
        raise ConfigError("ring.key_counts", f"member {position} (rank {ring.comm.rank}) holds {k.shape[-2]} keys, "
                                             f"key_counts says {counts[position]}: give every member's own count")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, scale: float | None = None, *,
                   kernel: BlockKernel | None = None) -> torch.Tensor:
    """``softmax(q k^T scale) v`` over the keys of all ring members, differentiable in q, k and v.

    ``q`` (B, H, n_q, D): this rank's queries; ``k``, ``v`` (B, H, n_k, D): its keys/values, ``n_k =
    ring.key_counts[own position]``. Returns (B, H, n_q, D): what one process computes on the concatenated keys
    (member 0's first), exact up to summation order. ``scale`` defaults to ``D ** -0.5``; ``kernel`` to the fused
    kernel where one returns the lse, else the plain matmul path (``blocks.block_kernel``: fp16/bf16/fp32 take
    the fused kernel of CUDA or CPU, float64 the plain path)."""
    check_ring_inputs(q, k, v, ring)
    chosen = block_kernel(q) if kernel is None else kernel
    out: torch.Tensor = _RingAttention.apply(q, k, v, ring, default_scale(q) if scale is None else scale, chosen)
    return out
