"""MPI: the collectives ZeRO's shards move by (``Comm.reduce_scatter``, ``Comm.all_gather``), uneven and empty pieces,
on the world and on a group, on this run's data plane.

Usage: python -m tests.mpi.zero_planes [--backend=gloo]. Checks: ``reduce_scatter uneven`` and ``all_gather uneven``
(world and the group of every rank but 0; the pieces' sizes differ per member, one is empty; float64 exact).
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


def main(check: Checks) -> None:
    options = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    ctx = dl.init(backend=options.get("backend", "auto"))
    tail = ctx.new_group(range(1, ctx.world_size))
    for name, run in (("reduce_scatter uneven", check_reduce_scatter), ("all_gather uneven", check_all_gather)):
        with check(name) as result:
            run(ctx, None)
            run(ctx, tail)
            result.detail = f"counts {counts_of(ctx.world_size)} on {ctx.plane}"


if __name__ == "__main__":
    run_checks(main)
