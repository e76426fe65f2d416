"""Ring attention across ranks (issue 52): outputs and dQ/dK/dV equal to one process's ``softmax(q k^T) v`` on the
concatenated keys, rings of 1..4 members (sub-groups of one 4-rank launch, also in an order unlike the ranks'),
equal and unequal key counts, one query per member, float32, the fused kernels' call pattern (CPU flash SDPA); the
trace's post-before-compute order and bytes; the activations kept per rank against blockwise attention in one
process; no tensor of ``n_q x all keys`` elements allocated (a dispatch mode records every op's outputs).

Usage: python -m tests.mpi.ring_attention_checks [--backend=gloo]   (4 ranks)
Named checks: ``check_names()``. Tiny tensors: the checks compute in about a second per rank; the dispatch mode's
first use imports torch._dynamo (a few CPU-seconds per rank unless an earlier job of the launch did).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

import mpi4dl_nb as dl
from mpi4dl_nb.comm.handles import Group
from mpi4dl_nb.comm.protocol import Comm
from mpi4dl_nb.comm.trace import Event
from mpi4dl_nb.spatial.tokens.blocks import CPU_FLASH, BlockKernel, FusedBlocks
from mpi4dl_nb.spatial.tokens.blockwise import blockwise_attention
from mpi4dl_nb.spatial.tokens.ring import Ring, ring_attention
from tests.support.allocations import Allocations
from tests.support.checks import Checks, run_checks
from tests.support.planes import split_backend

WORLD = 4
RTOL64 = 1e-12
RTOL32 = 2e-5


@dataclass(frozen=True)
class Case:
    """One ring: its key counts (its size), query counts, dtype, kernel."""

    name: str
    key_counts: tuple[int, ...]
    query_counts: tuple[int, ...] | None = None     # None: each member's queries are its keys' tokens
    dtype: torch.dtype = torch.float64
    kernel: Callable[[], BlockKernel] | None = None
    ranks: tuple[int, ...] | None = None            # the ring's ranks in ring order (None: 0 .. P-1)

    @property
    def members(self) -> tuple[int, ...]:
        return tuple(range(len(self.key_counts))) if self.ranks is None else self.ranks

    @property
    def queries(self) -> tuple[int, ...]:
        return self.key_counts if self.query_counts is None else self.query_counts

    @property
    def rtol(self) -> float:
        return RTOL64 if self.dtype == torch.float64 else RTOL32


CASES = (
    Case("P=1", (5,)),
    Case("P=2 equal counts", (4, 4)),
    Case("P=3 equal counts", (3, 3, 3)),
    Case("P=4 equal counts", (3, 3, 3, 3)),
    Case("P=2 unequal counts", (6, 2)),
    Case("P=3 unequal counts (class token on member 0)", (5, 4, 2)),
    Case("P=4 unequal counts", (5, 1, 4, 3)),
    Case("P=4 one query per member", (4, 3, 5, 2), query_counts=(1, 1, 1, 1)),
    Case("P=3 queries unlike keys", (2, 5, 3), query_counts=(4, 1, 2)),
    Case("P=4 float32", (4, 3, 5, 2), dtype=torch.float32),
    Case("P=3 fused kernel call pattern (CPU flash SDPA)", (4, 2, 3), kernel=lambda: FusedBlocks(CPU_FLASH)),
    Case("P=3 on ranks 3, 1, 2 (ring order unlike rank order)", (2, 4, 3), ranks=(3, 1, 2)),
    Case("P=4 on ranks 2, 0, 3, 1, one query per member", (3, 5, 2, 4), query_counts=(1, 1, 1, 1), ranks=(2, 0, 3, 1)),
)
TRACE = "P=4 trace: every next block posted before the current block's compute ends"
BYTES = "P=4 trace bytes equal ring.traffic"
SAVED = "P=4 activations kept per rank at most 1.15/P of blockwise attention in one process"
NO_FULL_SCORES = "P=4 no tensor of n_q x all keys elements (positive control: plain attention is caught)"
BATCH, HEADS, DIM = 2, 3, 4


def check_names() -> list[str]:
    return [case.name for case in CASES] + [TRACE, BYTES, SAVED, NO_FULL_SCORES]


def offsets(counts: tuple[int, ...], position: int) -> slice:
    start = sum(counts[:position])
    return slice(start, start + counts[position])


def full_tensors(case: Case, generator: torch.Generator) -> list[torch.Tensor]:
    """q (all members' queries), k, v, and the output's gradient, the same on every rank."""
    shape = (BATCH, HEADS)
    n_q, n_k = sum(case.queries), sum(case.key_counts)
    sizes = ((*shape, n_q, DIM), (*shape, n_k, DIM), (*shape, n_k, DIM), (*shape, n_q, DIM))
    return [torch.randn(size, generator=generator, dtype=torch.float64) for size in sizes]


def one_process(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """Output, dQ, dK, dV of plain attention on the concatenated tensors."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = torch.softmax(q @ k.transpose(-2, -1) * DIM ** -0.5, -1) @ v
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), grad)]


def on_ring(case: Case, ring: Ring, full: list[torch.Tensor]) -> list[torch.Tensor]:
    """This member's output, dQ, dK, dV by ring attention on its slices."""
    position = ring.position
    q_full, k_full, v_full, grad_full = full
    own_q, own_k = offsets(case.queries, position), offsets(case.key_counts, position)
    q, k, v = (t[..., rows, :].to(case.dtype).requires_grad_()
               for t, rows in ((q_full, own_q), (k_full, own_k), (v_full, own_k)))
    kernel = case.kernel() if case.kernel is not None else None
    out = ring_attention(q, k, v, ring, kernel=kernel)
    grads = torch.autograd.grad(out, (q, k, v), grad_full[..., own_q, :].to(case.dtype))
    return [out.detach(), *grads]


def worst_error(case: Case, ring: Ring, full: list[torch.Tensor]) -> float:
    """The worst relative error of this member's output and gradients against one process's slices."""
    want = one_process(*full)
    got = on_ring(case, ring, full)
    position = ring.position
    rows = [offsets(case.queries, position)] * 2 + [offsets(case.key_counts, position)] * 2
    worst = 0.0
    for name, expected, actual, own in zip(("out", "dq", "dk", "dv"), want, got, rows):
        expected = expected[..., own, :]
        error = float((actual.double() - expected).abs().max() / expected.abs().max())
        assert error <= case.rtol, f"{name}: relative error {error:.2e} > {case.rtol:.0e}"
        worst = max(worst, error)
    return worst


def check_allocations(ring: Ring) -> str:
    """Forward + backward never returns a tensor of n_q x N elements (one batch entry, one head); plain attention
    on the same queries and all keys does (so the recorder sees backward's ops too)."""
    counts = ring.key_counts
    own = offsets(counts, ring.position)
    q_full, k_full, v_full, grad_full = (torch.randn(1, 1, sum(counts), 3, dtype=torch.float64) for _ in range(4))
    q, k, v = (t[..., own, :].clone().requires_grad_() for t in (q_full, k_full, v_full))
    limit = q.shape[-2] * sum(counts)
    with Allocations() as ring_record:
        torch.autograd.grad(ring_attention(q, k, v, ring), (q, k, v), grad_full[..., own, :])
    with Allocations() as plain_record:
        all_k, all_v = k_full.requires_grad_(), v_full.requires_grad_()
        plain = torch.softmax(q @ all_k.transpose(-2, -1), -1) @ all_v
        torch.autograd.grad(plain, (q, all_k, all_v), grad_full[..., own, :])
    assert ring_record.largest < limit, f"ring made a tensor of {ring_record.largest} >= {limit} elements"
    assert plain_record.largest >= limit, "the recorder missed plain attention's scores"
    return f"largest ring tensor {ring_record.largest} elements < n_q x N = {limit}"


def saved_bytes(attend: Callable[[], torch.Tensor]) -> int:
    """Bytes of the tensors autograd saves for backward while ``attend()`` runs (what activation memory keeps)."""
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attend()
    return sum(sizes)


def check_saved(ring: Ring) -> str:
    """The activations one layer keeps on each member are at most 1.15/P of blockwise attention's in one process."""
    full = [torch.randn(2, 6, sum(ring.key_counts), 16, dtype=torch.float64).requires_grad_() for _ in range(3)]
    own = offsets(ring.key_counts, ring.position)
    mine = [t[..., own, :].detach().requires_grad_() for t in full]
    ring_bytes = saved_bytes(lambda: ring_attention(*mine, ring))
    one_process = saved_bytes(lambda: blockwise_attention(*full, max(ring.key_counts)))
    bound = 1.15 / ring.size * one_process
    assert 0 < ring_bytes <= bound, f"ring keeps {ring_bytes} B, more than 1.15/P of {one_process} B"
    return f"{ring_bytes} B per rank, one process {one_process} B"


def traced_events(ring: Ring, ctx: Comm) -> list[Event]:
    """The events one forward + backward of a P=4 ring recorded on this rank."""
    full = full_tensors(Case("trace", ring.key_counts), torch.Generator().manual_seed(5))
    start = ctx.tracer.recorded
    on_ring(Case("trace", ring.key_counts), ring, full)
    return ctx.tracer.since(start)


def check_trace(events: list[Event], size: int) -> str:
    """For each pass and step that passes a block on, its ring_send precedes the end of that step's ring_block."""
    for what in ("forward", "backward"):
        sends = {e.extra["step"]: e for e in events if e.op == "ring_send" and e.extra["what"] == what}
        blocks = {e.extra["step"]: e for e in events if e.op == "ring_block" and e.extra["what"] == what}
        assert sorted(sends) == list(range(size - 1)), f"{what}: blocks sent at steps {sorted(sends)}"
        assert sorted(blocks) == list(range(size)), f"{what}: blocks computed at steps {sorted(blocks)}"
        for step, send in sends.items():
            assert send.start <= blocks[step].start <= blocks[step].end, \
                f"{what} step {step}: posted at {send.start:.6f}, compute {blocks[step].start:.6f}.." \
                f"{blocks[step].end:.6f}"
    assert {e.extra["layer"] for e in events if e.op.startswith("ring_")} == {"blocks.3.attn"}
    gradients = [e for e in events if e.op == "ring_send" and e.extra["what"] == "gradient"]
    assert len(gradients) == size - 1, f"{len(gradients)} gradient sends, want {size - 1} (the own share stays)"
    return f"{2 * (size - 1)} key/value posts, each before its step's compute"


def check_bytes(events: list[Event], ring: Ring) -> str:
    sent = {what: sum(e.bytes for e in events if e.op == "ring_send" and e.extra["what"] in whats)
            for what, whats in (("forward", ("forward",)), ("backward", ("backward", "gradient")))}
    want = ring.traffic(BATCH, HEADS, DIM, torch.float64)
    assert (sent["forward"], sent["backward"]) == (want.forward, want.backward), f"sent {sent}, predicted {want}"
    return f"forward {want.forward} B, backward {want.backward} B"


def run_cases(check: Checks, ctx: Comm, rings: dict[tuple[int, ...], Group]) -> None:
    generator = torch.Generator().manual_seed(52)
    for case in CASES:
        full = full_tensors(case, generator)        # every rank draws every case's tensors: same stream
        group = rings[case.members]
        if ctx.rank not in group:
            continue
        with check(case.name) as result:
            ring = Ring(ctx, group, case.key_counts)
            result.detail = f"worst rel err {worst_error(case, ring, full):.1e}"


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    backend, _ = split_backend(sys.argv[1:])
    ctx = dl.init(backend=backend)
    assert ctx.world_size == WORLD, f"run with {WORLD} ranks"
    rings = {case.members: ctx.new_group(case.members) for case in CASES}   # the same order on every rank
    run_cases(check, ctx, rings)
    world = ctx.new_group(range(WORLD))
    ring = Ring(ctx, world, (5, 1, 4, 3), name="blocks.3.attn")
    events = traced_events(ring, ctx)
    with check(TRACE) as result:
        result.detail = check_trace(events, WORLD)
    with check(BYTES) as result:
        result.detail = check_bytes(events, ring)
    with check(SAVED) as result:
        result.detail = check_saved(Ring(ctx, world, (8, 8, 8, 8)))
    with check(NO_FULL_SCORES) as result:
        result.detail = check_allocations(Ring(ctx, world, (6, 5, 7, 4)))
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
