"""Planner estimate vs measured peak memory per rank, for several configurations side by side.

    .venv/bin/python benchmarks/bench_planner.py                 # default table (~2 min)
    .venv/bin/python benchmarks/bench_planner.py --image-size 256 --width 16 --markdown

Each configuration runs on a local MPI cluster of its world size (one cluster start per
world size); every rank measures one HybridEngine.train_step after a warm-up step
(PyTorch profiler allocation peak + parameters/optimizer state) and the planner estimates
the same from layer shapes on the meta device. Prints per-rank MB and estimate/measured.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from mpi4dl_nb import ParallelConfig, planner
from mpi4dl_nb import cluster as clu
from mpi4dl_nb.models import build_model

CASES = [
    ("serial", dict(split_size=1, spatial_size=0), 2),
    ("SP2v+LP", dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical"), 2),
    ("SP2v+LP, 2 micro-batches", dict(split_size=2, spatial_size=1, num_spatial_parts=2,
                                      slice_method="vertical", parts=2), 4),
    ("LP3, GPipe m=2", dict(split_size=3, spatial_size=0, parts=2), 2),
    ("LP3, 1F1B m=4", dict(split_size=3, spatial_size=0, parts=4, schedule="1f1b"), 4),
    ("LP3 GEMS", dict(split_size=3, spatial_size=0, times=1), 2),
    ("SP4+LP", dict(split_size=2, spatial_size=1, num_spatial_parts=4), 2),
]


def measure_on_engine(knobs, image_size, batch, depth, width):
    import torch
    from torch import nn

    import mpi4dl_nb as dl
    from mpi4dl_nb.models import build_model
    from mpi4dl_nb.notebook.planner import measure_engine_step

    torch.set_num_threads(1)
    ctx = dl.init()
    torch.manual_seed(0)
    eng = dl.HybridEngine(build_model("resnet", num_layers=depth, num_filters=width, num_classes=2),
                          dl.ParallelConfig(**knobs), ctx, loss_fn=nn.CrossEntropyLoss(),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    x, y = torch.randn(batch, 3, image_size, image_size), torch.randint(0, 2, (batch,))
    return measure_engine_step(eng, x, y)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--depth", type=int, default=11)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    layers = build_model("resnet", num_layers=args.depth, num_filters=args.width, num_classes=2)
    profiles = planner.profile_layers(layers, args.image_size)
    cases = sorted(CASES, key=lambda case: ParallelConfig(**case[1]).world_size)
    rows = []
    start = time.monotonic()
    for world, group in itertools.groupby(cases, key=lambda case: ParallelConfig(**case[1]).world_size):
        with clu.start(n=world, call_timeout=900) as cluster:
            for name, knobs, batch in group:
                plan = planner.estimate_memory(profiles, ParallelConfig(**knobs), args.image_size, batch)
                measured = cluster.run(measure_on_engine, knobs, args.image_size, batch,
                                       args.depth, args.width)
                rows.append((name, world, batch, plan.totals, measured))
    mb = 2 ** 20
    if args.markdown:
        print("| configuration | ranks | batch | per rank: estimate / measured MB (ratio) | worst |")
        print("|---|---|---|---|---|")
    for name, world, batch, est, got in rows:
        ratios = [e / m for e, m in zip(est, got)]
        worst = max(ratios, key=lambda r: abs(r - 1))
        cells = "; ".join(f"r{r}: {e / mb:.1f}/{m / mb:.1f} ({e / m:.2f})"
                          for r, (e, m) in enumerate(zip(est, got)))
        if args.markdown:
            print(f"| {name} | {world} | {batch} | {cells} | {worst:.2f} |")
        else:
            print(f"{name:28s} ranks {world} batch {batch}  worst ratio {worst:.2f}  | {cells}")
    within = sum(all(abs(e / m - 1) < 0.25 for e, m in zip(est, got)) for *_, est, got in rows)
    print(f"\n{within}/{len(rows)} configurations within 25% on every rank "
          f"(ResNet-{args.depth} v2, width {args.width}, {args.image_size}px, float32; "
          f"{time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
