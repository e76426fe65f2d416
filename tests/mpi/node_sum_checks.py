"""Sums through the node's shared memory (``comm.node_sum.NodeSum``, issue 67) on 3 ranks of one node.

Usage: mpiexec -n 3 python -m tests.mpi.node_sum_checks
Three members make the order of a sum matter: every member must get ``(a + b) + c`` of the members' tensors in rank
order, bit for bit and the same on each, whatever tensor spans two members' shares. Then: the window grows for a
larger sum; a group of two of the three ranks sums on its own; a node without room in ``/dev/shm`` declines on
every member alike (no member may go on to a sum the others skip).
"""

from __future__ import annotations

import torch

from mpi4dl_nb.comm import node_sum
from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.comm.handles import Group
from mpi4dl_nb.comm.node_sum import NodeSum
from tests.support.checks import Checks, run_checks

CHECKS = ("float64 and float32 parts sum in rank order, the same bits on every member",
          "the window grows for a larger sum",
          "a group of two of the three ranks sums on its own",
          "a node without room declines on every member")


def parts_of(seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Tensors of awkward shapes: a transposed (non-contiguous) one, an empty one, some across two shares."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 7, dtype=dtype, generator=g).t(), torch.randn(0, dtype=dtype),
            torch.randn(31, dtype=dtype, generator=g), torch.randn(2, 3, 4, dtype=dtype, generator=g)]


def rank_order_sum(ctx: Context, parts: list[torch.Tensor], group: Group | None = None,
                   reverse: bool = False) -> list[torch.Tensor]:
    everyone = ctx.all_gather_object([p.clone() for p in parts], group=group)
    if reverse:
        everyone.reverse()
    total = [p.clone() for p in everyone[0]]
    for theirs in everyone[1:]:
        for mine, other in zip(total, theirs):
            mine += other
    return total


def summed(node: NodeSum, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    assert node.reserve(sum(p.numel() * p.element_size() for p in parts))
    node.all_reduce(parts)
    return parts


def same_everywhere(ctx: Context, tensors: list[torch.Tensor], group: Group | None = None) -> bool:
    return all(all(torch.equal(a, b) for a, b in zip(tensors, theirs))
               for theirs in ctx.all_gather_object(tensors, group=group))


def check_rank_order(ctx: Context) -> str:
    node = ctx.node_sum()
    assert node is not None and node.size == 3
    found = []
    for dtype in (torch.float64, torch.float32):
        parts = parts_of(10 + ctx.rank, dtype)
        want = rank_order_sum(ctx, parts)
        other_order = rank_order_sum(ctx, parts, reverse=True)
        differ = sum(int((a != b).sum()) for a, b in zip(want, other_order))
        got = summed(node, parts)
        for index, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"{dtype}, part {index}: {float((a - b).abs().max()):.3e}"
        assert same_everywhere(ctx, got)
        found.append(f"{str(dtype).removeprefix('torch.')} ({differ} of {sum(p.numel() for p in parts)} elements "
                     f"differ in the reverse order)")
        assert differ, f"{dtype}: no element tells the orders apart, the check would not see a wrong order"
    return f"{' and '.join(found)}: equal to the rank-order sum on all 3 members"


def check_growth(ctx: Context) -> str:
    node = ctx.node_sum()
    assert node is not None
    before = node.capacity
    big = [torch.randn(50_000, dtype=torch.float64, generator=torch.Generator().manual_seed(ctx.rank))]
    want = rank_order_sum(ctx, big)
    got = summed(node, big)
    assert node.capacity > before, (node.capacity, before)
    assert torch.equal(got[0], want[0])
    return f"window {before} -> {node.capacity} bytes a member, sum right"


def check_subgroup(ctx: Context) -> str:
    group = ctx.new_group([0, 2])
    if ctx.rank not in group:
        return "rank 1 stays out"
    node = ctx.node_sum(group)
    assert node is not None and node.size == 2
    parts = parts_of(20 + ctx.rank, torch.float64)
    want = rank_order_sum(ctx, parts, group)
    got = summed(node, parts)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert same_everywhere(ctx, got, group)
    return "ranks 0 and 2 summed on a window of their own"


def check_no_room(ctx: Context) -> str:
    node = ctx.node_sum()
    assert node is not None
    before = node.capacity
    original = node_sum.shm_room
    node_sum.shm_room = lambda path=node_sum.SHM_DIR: 1 << 10 if ctx.rank == 0 else 1 << 40   # noqa: ARG005
    try:
        declined = not node.reserve(before + (1 << 20))
        within = node.reserve(before)
    finally:
        node_sum.shm_room = original
    answers = ctx.all_gather_object((declined, within, node.capacity))
    assert all(answer == (True, True, before) for answer in answers), answers
    return f"every member declined 1 MB more with 1 kB free on the node (member 0 asks); {before} bytes kept"


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = Context()
    assert ctx.world_size == 3, "run with 3 ranks"
    for name, run in zip(CHECKS, (check_rank_order, check_growth, check_subgroup, check_no_room)):
        with check(name) as result:
            result.detail = run(ctx)
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
