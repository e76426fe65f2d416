"""Halo overlap: a spatial conv stack's forward with the owned tile computed while the row halos fly, vs not.

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 OMP_NUM_THREADS=1 \\
        mpiexec -n 2 python benchmarks/bench_overlap.py --size 2048 --backend mpi
    (and --backend gloo: the torch plane, whose messages progress on gloo's own threads)

A 3-layer 16-channel 3x3 conv stack on 2 ranks (2 tiles on top of each other: every conv
exchanges rows, the copy-free banded path). Rounds alternate ``spatial.conv.HALO_OVERLAP``
on and off, side by side in one run; printed: best forward and forward+backward seconds of
each, and the halo exchanges' own time per forward (trace, rank 0) — what overlap can hide
at most. Outputs are checked equal both ways.
"""

from __future__ import annotations

import argparse
import time

import torch

import mpi4dl_nb as dl
from mpi4dl_nb.spatial import conv as spatial_conv
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tiles import scatter_tiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = dl.init(backend=args.backend)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    cin = 3
    for _ in range(3):
        layers += [torch.nn.Conv2d(cin, 16, 3, padding=1), torch.nn.ReLU()]
        cin = 16
    grid = TileGrid(ctx.world_size, 1)
    net = spatialize(torch.nn.Sequential(*layers), grid, ctx, image_size=(args.size, args.size))
    tile = scatter_tiles(torch.randn(1, 3, args.size, args.size), grid, ctx)
    best = {True: [float("inf"), float("inf"), 0.0], False: [float("inf"), float("inf"), 0.0]}
    outputs = {}
    for _ in range(args.rounds):
        for overlap in (True, False):
            spatial_conv.HALO_OVERLAP = overlap
            ctx.barrier()
            halo = ctx.tracer.totals().get("halo")
            halo_before = halo.seconds if halo else 0.0
            start = time.perf_counter()
            out = net(tile)
            forward = time.perf_counter() - start
            halo = ctx.tracer.totals().get("halo")
            halo_seconds = (halo.seconds if halo else 0.0) - halo_before
            out.sum().backward()
            step = time.perf_counter() - start
            net.zero_grad(set_to_none=True)
            outputs[overlap] = out.detach()
            entry = best[overlap]
            entry[0], entry[1] = min(entry[0], forward), min(entry[1], step)
            entry[2] = halo_seconds
    assert torch.equal(outputs[True], outputs[False])
    rows = ctx.all_gather_object({k: list(v) for k, v in best.items()})
    if ctx.rank == 0:
        print(f"conv stack 3x16ch 3x3, {args.size}x{args.size}, {ctx.world_size} ranks ({grid.rows}x1), "
              f"plane {ctx.backend}, best of {args.rounds} (slowest rank)")
        print("| halo overlap | forward s | forward+backward s | halo exchanges in a forward (rank 0) s |")
        print("|---|---:|---:|---:|")
        for overlap in (True, False):
            forward = max(r[overlap][0] for r in rows)
            step = max(r[overlap][1] for r in rows)
            print(f"| {'on' if overlap else 'off'} | {forward:.3f} | {step:.3f} | {rows[0][overlap][2]:.4f} |")
    ctx.barrier()


if __name__ == "__main__":
    main()
