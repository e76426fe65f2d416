"""The auto-tune's order of steps: does the row stepped right after the one-process reference run slower?

    python benchmarks/bench_tune_order.py                  # 5 jobs per order (~8 min)
    python benchmarks/bench_tune_order.py --jobs 3

Each job is what ``python -m mpi4dl_nb tune`` measures on 5 ranks (``OMP_NUM_THREADS=1``): the
one-process reference and four rows, the same configuration A (AmoebaNet-3 w64, 256 px, SP 2x1 on
1 stage + LP 3 stages) as rows 1 and 3 and its mirror image B (1x2 tiles) as rows 2 and 4, built
side by side and timed interleaved (``measure.trials.measure_interleaved``, 2 rounds of 8 steps). Row 1
and row 3 are one configuration, so their medians differ only by where they stand. Per job:
row 1's median over row 3's. ``fixed``: every pass in the order reference, 1, 2, 3, 4 (as
before 6db2e24), so row 1 always runs right after the reference. ``balanced``: each pass in
its own order (``measure.trials.pass_order``, a Williams design), as tune does now.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from support.launch import run_job
from support.machine import Footer

WORLD = 5
TILES = {"split_size": 4, "spatial_size": 1, "num_spatial_parts": 2}
ROWS = [None, {**TILES, "slice_method": "horizontal"}, {**TILES, "slice_method": "vertical"},
        {**TILES, "slice_method": "horizontal"}, {**TILES, "slice_method": "vertical"}]
ORDERS = ("fixed", "balanced")


def child(order: str, steps: int, rounds: int) -> None:
    """One job's rank: measure ROWS interleaved; rank 0 prints the medians as JSON."""
    import mpi4dl_nb as dl
    from mpi4dl_nb.measure import trials

    if order == "fixed":
        trials.pass_order = lambda rows, index: list(range(rows))   # the order before 6db2e24
    ctx = dl.init()
    spec = trials.ModelSpec("amoebanet", 3, 64)
    measured = trials.measure_interleaved(trials.here, spec, ROWS, 256, 2, steps, rounds)
    if ctx.rank == 0:
        print("MEDIANS " + json.dumps([m.seconds for m in measured]), flush=True)


def job(order: str, steps: int, rounds: int) -> list[float]:
    """One mpiexec job of ``child``; the rows' median step seconds."""
    done = run_job(WORLD, [sys.executable, __file__, "--child", order, "--steps", str(steps), "--rounds", str(rounds)],
                   timeout=900)
    line = next((line for line in done.stdout.splitlines() if "MEDIANS " in line), None)
    if line is None:
        raise RuntimeError(f"{order} job printed no medians:\n{done.stderr[-2000:]}")
    return json.loads(line.split("MEDIANS ", 1)[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=5, help="jobs per order (the two orders alternate)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", choices=ORDERS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.steps, args.rounds)
        return 0
    if min(args.jobs, args.steps, args.rounds) < 1:
        parser.error("--jobs, --steps and --rounds must be at least 1")
    footer = Footer()
    start = time.monotonic()
    ratios: dict[str, list[float]] = {order: [] for order in ORDERS}
    for index in range(args.jobs):
        for order in ORDERS:
            medians = job(order, args.steps, args.rounds)
            ratios[order].append(medians[1] / medians[3])
            print(f"job {index + 1} {order:8s} reference {medians[0]:.3f} s, A {medians[1]:.3f} / {medians[3]:.3f} s, "
                  f"B {medians[2]:.3f} / {medians[4]:.3f} s: row 1 / row 3 = {ratios[order][-1]:.3f}", flush=True)
    print()
    for order in ORDERS:
        found = ratios[order]
        print(f"{order:8s} row 1 / row 3: mean {statistics.mean(found):.3f}, slower in {sum(r > 1 for r in found)} "
              f"of {len(found)} jobs (range {min(found):.3f}-{max(found):.3f})")
    print(f"{time.monotonic() - start:.0f} s")
    footer.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
