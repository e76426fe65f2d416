"""MPI: the collectives ZeRO's shards move by (``Comm.reduce_scatter``, ``Comm.all_gather``), uneven and empty pieces,
on the world and on a group, on this run's data plane.

Usage: python -m tests.mpi.zero_planes [--backend=gloo]. Checks: ``reduce_scatter uneven`` and ``all_gather uneven``
(world and the group of every rank but 0; the pieces' sizes differ per member, one is empty; float64 exact); on the
mpi plane also ``node shards`` (``comm/node_shards.py``, the route of holders on one node): the same pieces as those
collectives, each member's piece in two tensors; slices written early (``comm/node_writes.EarlyWrites``) are used
(their tensors zeroed after without a version bump), and a claim lost to a ``NodeSum`` sum in between writes them
again; memory every member maps (``common``) holds the
tensors given and shows each member's writes to all.
"""

from __future__ import annotations

import sys

import torch

import mpi4dl_nb as dl
from tests.support.checks import Checks, run_checks


def counts_of(size: int) -> list[int]:
    return [(3, 0, 5, 1, 2, 4)[i % 6] for i in range(size)]


def check_reduce_scatter(ctx, group) -> None:
    ranks = group.ranks if group is not None else tuple(range(ctx.world_size))
    if ctx.rank not in ranks:
        return
    counts = counts_of(len(ranks))
    flat = torch.arange(sum(counts), dtype=torch.float64, device=ctx.device) * (ctx.rank + 1)
    piece = ctx.reduce_scatter(flat, counts, group)
    index = ranks.index(ctx.rank)
    start = sum(counts[:index])
    want = torch.arange(start, start + counts[index], dtype=torch.float64) * sum(r + 1 for r in ranks)
    assert torch.equal(piece.cpu(), want), (piece, want)


def check_all_gather(ctx, group) -> None:
    ranks = group.ranks if group is not None else tuple(range(ctx.world_size))
    if ctx.rank not in ranks:
        return
    counts = counts_of(len(ranks))
    mine = counts[ranks.index(ctx.rank)]
    whole = ctx.all_gather(torch.full((mine,), float(ctx.rank), dtype=torch.float64, device=ctx.device), counts,
                           group)
    want = torch.cat([torch.full((c,), float(r), dtype=torch.float64) for r, c in zip(ranks, counts)])
    assert torch.equal(whole.cpu(), want), (whole, want)


def check_node_shards(ctx) -> None:
    from mpi4dl_nb.comm.node_shards import NodeShards
    from mpi4dl_nb.comm.node_writes import EarlyWrites

    counts = counts_of(ctx.world_size)
    node = NodeShards.reserved(ctx.node_sum(), torch.float64, sum(counts))
    assert node is not None, "one node, room in /dev/shm: the window's route"
    values = torch.arange(sum(counts), dtype=torch.float64) * (ctx.rank + 1)   # integers: any order sums alike
    starts = [sum(counts[:m]) for m in range(ctx.world_size)]
    halves = [(s, c // 2) for s, c in zip(starts, counts)]
    firsts = [2 * m for m in range(ctx.world_size) if m != ctx.rank]   # every other member's first tensor
    places = [[] if m == ctx.rank else [(s, 0, h)] if k == 0 else [(s + h, 0, c - h)]
              for m, ((s, h), c) in enumerate(zip(halves, counts)) for k in (0, 1)]
    for lost in (False, True):
        tensors = [t.clone() for s, c in zip(starts, counts) for t in (values[s:s + c // 2], values[s + c // 2:s + c])]
        writes = EarlyWrites(node.node, places, lambda: node.slab(sum(counts)))
        for index in firsts:
            writes.write(index, tensors[index])
        if lost:
            ctx.node_sum().all_reduce([torch.ones(sum(counts), dtype=torch.float64)])   # drops the claim
        for index in firsts:
            tensors[index].data.zero_()    # no version bump: the copies written early stand for them while kept
        writes.refresh(tensors)
        zeroed = values.clone()
        for m, (s, h) in enumerate(halves):
            if lost and m != ctx.rank:
                zeroed[s:s + h] = 0.0
        want = ctx.reduce_scatter(zeroed, counts)
        got = node.reduce_scatter([tensors[2 * m:2 * m + 2] for m in range(ctx.world_size)], counts, written=True)
        assert torch.equal(got, want), (lost, got, want)
    pieces = [[values[s:s + c // 2], values[s + c // 2:s + c]] for s, c in zip(starts, counts)]
    mine = pieces[ctx.rank]
    outs = [[torch.empty(t.numel(), dtype=torch.float64) for t in tensors] for tensors in pieces]
    node.all_gather(mine, outs, counts)
    gathered = ctx.all_gather(values[starts[ctx.rank]:starts[ctx.rank] + counts[ctx.rank]], counts)
    assert torch.equal(torch.cat([t for tensors in outs for t in tensors]), gathered)
    check_common_memory(ctx, node)


def check_common_memory(ctx, node) -> None:
    """``NodeShards.common``: the tensors' values in one memory, each member's writes seen by all after ``meet``."""
    from mpi4dl_nb.sharding.plan import shard_bounds

    tensors = [torch.arange(1, 8, dtype=torch.float64), torch.arange(6, dtype=torch.float64).view(2, 3)]
    views = node.common(tensors, [shard_bounds(t.numel(), ctx.world_size, ctx.rank) for t in tensors])
    assert views is not None and all(torch.equal(v, t) for v, t in zip(views, tensors)), views
    node.meet()                                   # everyone has read them before anyone writes
    views[0][ctx.rank] = -1.0 - ctx.rank          # one element each
    node.meet()
    assert torch.equal(views[0][:ctx.world_size], -1.0 - torch.arange(ctx.world_size, dtype=torch.float64)), views
    node.meet()                                   # nobody writes again before everyone has read


def main(check: Checks) -> None:
    options = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    ctx = dl.init(backend=options.get("backend", "auto"))
    tail = ctx.new_group(range(1, ctx.world_size))
    for name, run in (("reduce_scatter uneven", check_reduce_scatter), ("all_gather uneven", check_all_gather)):
        with check(name) as result:
            run(ctx, None)
            run(ctx, tail)
            result.detail = f"counts {counts_of(ctx.world_size)} on {ctx.plane}"
    if ctx.plane == "mpi":
        with check("node shards") as result:
            check_node_shards(ctx)
            result.detail = (f"counts {counts_of(ctx.world_size)}, early writes used, a lost claim written again, "
                             "common memory seen by all")


if __name__ == "__main__":
    run_checks(main)
