"""suggest's first choice against the fastest measured of the candidates it ranked, scenario by scenario.

    python benchmarks/bench_suggest.py                      # every scenario, twice (~10 min)
    python benchmarks/bench_suggest.py --scenarios resnet-11 --repeats 3 --markdown

Each run is the live auto-tune a user starts (``python -m mpi4dl_nb tune`` under
``mpiexec -n 5``, ``OMP_NUM_THREADS=1``): the job calibrates itself, ``suggest`` ranks every
configuration of 5 ranks that fits the scenario's memory limit per rank, and the ``--top``
first ones are measured side by side (built together, ``--rounds`` rounds of ``--steps``
steps, one step of each in turn; a candidate's time is the median of its steps). One line
per run: suggest's first choice, the fastest measured candidate that fits, and the first
choice's measured time over the best one's (a first choice whose measured peak is over the
limit does not count as within); at the end, how many runs put the first choice within 10% of
the best.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass

from support.launch import run_job
from support.machine import Footer

WITHIN = 0.10
WORLD = 5


@dataclass(frozen=True)
class Scenario:
    """A model, its image size and a memory limit per rank that one process does not fit."""

    name: str
    model: str
    depth: int
    width: int
    image_size: int
    limit_mb: float

    def tune_args(self) -> list[str]:
        return ["--model", self.model, "--num-layers", str(self.depth), "--num-filters", str(self.width),
                "--image-size", str(self.image_size), "--batch-size", "2", "--memory-limit-mb", str(self.limit_mb)]


# one process needs (measured, float32, batch 2): 83.5, 245, 177, 365, 20.8, 105 MB
SCENARIOS = [
    Scenario("resnet-11", "resnet", 11, 16, 128, 50),
    Scenario("resnet-20", "resnet", 20, 8, 256, 150),
    Scenario("resnet-29", "resnet", 29, 16, 128, 100),
    Scenario("resnet-11-384", "resnet", 11, 8, 384, 200),
    Scenario("amoebanet-6", "amoebanet", 6, 32, 128, 12),
    Scenario("amoebanet-3", "amoebanet", 3, 64, 256, 60),
]


@dataclass
class Run:
    scenario: Scenario
    first: str
    first_seconds: float
    first_fits: bool                               # its measured peak within the limit on every rank
    best: str
    best_seconds: float
    predicted: list[tuple[str, float, float]]     # (label, predicted s, measured s) in suggest's order

    @property
    def ratio(self) -> float:
        return self.first_seconds / self.best_seconds

    @property
    def within(self) -> bool:
        return self.first_fits and self.ratio <= 1 + WITHIN

    @property
    def verdict(self) -> str:
        return "does not fit as measured" if not self.first_fits else "yes" if self.within else "no"


def tune_once(scenario: Scenario, top: int, steps: int, rounds: int) -> Run:
    """One ``python -m mpi4dl_nb tune`` job on 5 ranks; its JSON read back."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "tune.json")
        done = run_job(WORLD, [sys.executable, "-m", "mpi4dl_nb", "tune", *scenario.tune_args(), "--top", str(top),
                               "--steps", str(steps), "--rounds", str(rounds), "--save-json", path], timeout=3600)
        if not os.path.exists(path):
            raise RuntimeError(f"{scenario.name}: tune wrote no {path}:\n{done.stderr[-2000:]}")
        with open(path) as handle:
            result = json.load(handle)
    candidates = [row for row in result["rows"] if row["config"] is not None]
    fitting = [row for row in candidates if row["fits"]]
    if not fitting:
        raise RuntimeError(f"{scenario.name}: no measured candidate fits {scenario.limit_mb} MB")
    best = min(fitting, key=lambda row: row["measured_seconds"])
    first = candidates[0]
    return Run(scenario, first["label"], first["measured_seconds"], first["fits"], best["label"],
               best["measured_seconds"],
               [(row["label"], row["predicted_seconds"], row["measured_seconds"]) for row in candidates])


def print_run(run: Run, markdown: bool) -> None:
    order = "; ".join(f"{label} {p:.3f}/{m:.3f}" for label, p, m in run.predicted)
    if markdown:
        print(f"| {run.scenario.name} {run.scenario.limit_mb:g} MB | {run.first} | {run.first_seconds:.3f} | "
              f"{run.best} | {run.best_seconds:.3f} | {run.ratio:.2f} | {run.verdict} |",
              flush=True)
    else:
        print(f"{run.scenario.name:14s} {run.scenario.limit_mb:5g} MB  first choice {run.first} "
              f"{run.first_seconds:.3f} s, best {run.best} {run.best_seconds:.3f} s: {run.ratio:.2f}x"
              f"{'' if run.within else f'  ({run.verdict})'}\n    predicted/measured s: {order}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default=None,
                        help=f"comma-separated names (default: all of {', '.join(s.name for s in SCENARIOS)})")
    parser.add_argument("--repeats", type=int, default=2, help="tune jobs per scenario")
    parser.add_argument("--top", type=int, default=4, help="candidates measured per job")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per candidate and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of interleaved steps per job")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    if min(args.repeats, args.top, args.steps, args.rounds) < 1:
        parser.error("--repeats, --top, --steps and --rounds must be at least 1")
    known = {s.name: s for s in SCENARIOS}
    names = args.scenarios.split(",") if args.scenarios else list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}: use {', '.join(known)}")
    footer = Footer()
    start = time.monotonic()
    if args.markdown:
        print("| scenario (5 ranks, limit per rank) | suggest's first choice | measured s | fastest measured | "
              "measured s | ratio | within 10% |")
        print("|---|---|---|---|---|---|---|")
    runs = []
    for name in names:
        for _ in range(args.repeats):
            run = tune_once(known[name], args.top, args.steps, args.rounds)
            runs.append(run)
            print_run(run, args.markdown)
    print(f"\nfirst choice within 10% of the fastest measured: {sum(r.within for r in runs)}/{len(runs)} runs "
          f"(worst {max(r.ratio for r in runs):.2f}x; --top {args.top} --steps {args.steps} --rounds {args.rounds}; "
          f"{time.monotonic() - start:.0f} s)")
    footer.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
