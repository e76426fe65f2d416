"""Ring attention against attention on all-gathered keys/values: bytes sent, largest score matrix, time per layer.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/bench_ring_attention.py
    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/bench_ring_attention.py --tokens 1024 --backend gloo

Every rank holds ``--tokens`` queries and keys (ViT-S/16 heads and head size by default: 6 x 64), batch 1. The
baseline gathers every member's keys/values around the same ring (a ring all-gather), runs plain attention on
them and reduce-scatters dK/dV back around the ring; ring attention (``spatial/tokens/ring.py``) never holds
more than one other member's block. Bytes are this rank's ``ring_send`` events (the trace), time the slowest
rank's median of forward + backward of one layer, both variants timed in turns.
"""

from __future__ import annotations

import argparse
from typing import Protocol

import torch
from support.machine import Footer
from support.tables import Table
from support.timing import in_turns

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.spatial.function_ctx import FunctionContext
from mpi4dl_nb.spatial.tokens.ring import GradientCarry, KeyValueTravel, Pass, Ring, RingLink, ring_attention


class _GatheredCtx(FunctionContext, Protocol):
    ring: Ring


def _rows(ring: Ring, owner: int) -> slice:
    start = sum(ring.key_counts[:owner])
    return slice(start, start + ring.key_counts[owner])


class AllGathered(torch.autograd.Function):
    """Attention on every member's keys/values gathered around the ring; dK/dV reduce-scattered back."""

    @staticmethod
    def forward(fctx: _GatheredCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
        shape = (*k.shape[:2], ring.total_keys, k.shape[-1])
        keys, values = k.new_empty(shape), v.new_empty(shape)
        for step, k_block, v_block in KeyValueTravel(ring, RingLink(ring)).blocks(k, v, Pass.FORWARD):
            keys[..., _rows(ring, step.owner), :] = k_block
            values[..., _rows(ring, step.owner), :] = v_block
        probabilities = torch.softmax(q @ keys.transpose(-2, -1) * q.shape[-1] ** -0.5, -1)
        fctx.save_for_backward(q, keys, values, probabilities)
        fctx.ring = ring
        return probabilities @ values

    @staticmethod
    def backward(fctx: _GatheredCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, keys, values, probabilities = fctx.saved_tensors
        ring, scale = fctx.ring, q.shape[-1] ** -0.5
        dv_all = probabilities.transpose(-2, -1) @ grad
        d_probabilities = grad @ values.transpose(-2, -1)
        d_scores = probabilities * (d_probabilities - (d_probabilities * probabilities).sum(-1, keepdim=True))
        dq, dk_all = d_scores @ keys * scale, d_scores.transpose(-2, -1) @ q * scale
        carry = GradientCarry(ring, RingLink(ring), keys)
        for step in ring.schedule.steps:
            rows = _rows(ring, step.owner)
            carry.add(step, dk_all[..., rows, :].contiguous(), dv_all[..., rows, :].contiguous())
        dk, dv = carry.home()
        return dq, dk, dv, None


def all_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
    out: torch.Tensor = AllGathered.apply(q, k, v, ring)
    return out


def layer(attend, inputs: list[torch.Tensor], ring: Ring, grad: torch.Tensor):  # type: ignore[no-untyped-def]
    """One attention layer's forward and backward; returns the output and the input gradients."""
    q, k, v = (t.detach().requires_grad_() for t in inputs)
    out = attend(q, k, v, ring)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), grad)]


def sent_bytes(ctx: Context, run) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Bytes this rank's ring_send events carried during ``run()``: forward, backward (key/values and gradients)."""
    start = ctx.tracer.recorded
    run()
    sends = [e for e in ctx.tracer.since(start) if e.op == "ring_send"]
    forward = sum(e.bytes for e in sends if e.extra["what"] == "forward")
    return forward, sum(e.bytes for e in sends) - forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="queries and keys per rank")
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--dim", type=int, default=64, help="head size")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backend", default="mpi")
    args = parser.parse_args()
    footer = Footer()
    torch.set_num_threads(1)
    ctx = Context(backend=args.backend)
    ring = Ring(ctx, None, (args.tokens,) * ctx.world_size)
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(ctx.rank)
    shape = (1, args.heads, args.tokens, args.dim)
    inputs = [torch.randn(shape, generator=generator, dtype=dtype) for _ in range(3)]
    grad = torch.randn(shape, generator=generator, dtype=dtype)
    variants = {"ring attention": ring_attention, "all-gathered keys/values": all_gathered}
    results = {name: layer(attend, inputs, ring, grad) for name, attend in variants.items()}
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(*results.values()))
    sent = {name: sent_bytes(ctx, lambda a=attend: layer(a, inputs, ring, grad)) for name, attend in variants.items()}
    seconds = in_turns(ctx, {name: (lambda a=attend: layer(a, inputs, ring, grad)) for name, attend in
                             variants.items()}, args.rounds)
    slowest = {name: max(ctx.all_gather_object(s)) for name, s in seconds.items()}
    blocks = {"ring attention": args.tokens, "all-gathered keys/values": ring.total_keys}
    if ctx.rank == 0:
        print(f"one attention layer, {ctx.world_size} ranks x {args.tokens} tokens, {args.heads} heads x {args.dim}, "
              f"{args.dtype}, {ctx.backend} plane; outputs and gradients agree within {worst:.1e} (relative)")
        table = Table(["variant", ">sent forward (rank 0)", ">sent backward (rank 0)",
                       ">largest scores (elements)", ">ms fwd+bwd (slowest rank, median)"])
        for name in variants:
            table.add(name, f"{sent[name][0]:,} B", f"{sent[name][1]:,} B",
                      f"{args.heads * args.tokens * blocks[name]:,}", f"{1e3 * slowest[name]:.1f}")
        print(table.markdown())
        footer.print()


if __name__ == "__main__":
    main()
