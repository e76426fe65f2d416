"""Planner memory estimate vs measured peak per rank with activation recomputation on.

    python benchmarks/bench_planner_recompute.py                  # ResNet-20 v2 w8 256 px
    python benchmarks/bench_planner_recompute.py --model amoebanet --depth 6 --width 32 --image-size 128
    python benchmarks/bench_planner_recompute.py --settings none,every --configs serial,SP4+LP

For each ``--checkpoint-activations`` setting (every, blocks, N) and configuration, the
planner's estimate (``estimate_memory``: the engine's per-segment recomputation, segments cut
by ``pipeline.recompute.segment_bounds``) next to the peak measured on every rank of a local
MPI cluster (one warm-up and one ``HybridEngine.train_step`` under the allocation profiler,
``measure.trials.measure_config``). One line per case: ``worst ratio`` (estimate/measured, the rank
furthest from 1), then each rank; ``--tables`` also prints the estimate's terms per rank.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from support.machine import Footer

from mpi4dl_nb import ParallelConfig, planner
from mpi4dl_nb import cluster as clu
from mpi4dl_nb.measure import trials

CASES = {
    "serial": (dict(split_size=1, spatial_size=0), 2),
    "SP2v+LP": (dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical"), 2),
    "SP4+LP": (dict(split_size=2, spatial_size=1, num_spatial_parts=4), 2),
    "LP3 GPipe m=2": (dict(split_size=3, spatial_size=0, parts=2), 2),
}
MB = 2 ** 20


def setting(text: str) -> str | int | None:
    return None if text == "none" else int(text) if text.isdigit() else text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("resnet", "amoebanet"), default="resnet")
    parser.add_argument("--depth", type=int, default=20)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--settings", default="every,blocks,2", help="comma-separated: none, every, blocks, N")
    parser.add_argument("--configs", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    parser.add_argument("--tables", action="store_true", help="print each estimate's terms per rank")
    args = parser.parse_args()
    spec = trials.ModelSpec(args.model, args.depth, args.width, num_classes=2)
    layers = spec.build()
    settings = [setting(s) for s in args.settings.split(",")]
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {list(CASES)}")
    label = f"{args.model}-{args.depth} w{args.width} {args.image_size}px"
    footer = Footer()
    start = time.monotonic()
    worst_all = []
    names.sort(key=lambda n: ParallelConfig(**CASES[n][0]).world_size)
    for world, group in itertools.groupby(names, key=lambda n: ParallelConfig(**CASES[n][0]).world_size):
        with clu.start(n=world, call_timeout=1800) as cluster:
            for name in group:
                base, batch = CASES[name]
                for checkpoint in settings:
                    knobs = dict(base, checkpoint_activations=checkpoint)
                    plan = planner.estimate_memory(layers, ParallelConfig(**knobs), args.image_size, batch)
                    measured = cluster.run(trials.measure_config_on_engine, spec, knobs, args.image_size, batch, 1)[0]
                    ratios = [e / m for e, m in zip(plan.totals, measured.peaks)]
                    worst = max(ratios, key=lambda r: abs(r - 1))
                    worst_all.append(worst)
                    cells = "; ".join(f"r{r}: {e / MB:.1f}/{m / MB:.1f} ({q:.2f})" for r, (e, m, q)
                                      in enumerate(zip(plan.totals, measured.peaks, ratios)))
                    print(f"{label:24s} {name:14s} checkpoint {str(checkpoint):6s} worst ratio {worst:.2f}  | {cells}",
                          flush=True)
                    if args.tables:
                        print(plan.table(), flush=True)
    within = sum(abs(w - 1) <= 0.15 for w in worst_all)
    print(f"\nwithin 15% on every rank: {within}/{len(worst_all)} ({time.monotonic() - start:.0f} s)")
    footer.print()
    return 0 if within == len(worst_all) else 1


if __name__ == "__main__":
    sys.exit(main())
