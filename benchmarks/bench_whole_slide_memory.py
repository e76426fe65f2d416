"""Whole-slide training to the memory limit: the largest square canvas 1, 4 and 8 tile ranks train per rank budget.

For each trunk (torchvision ResNet-18 and ResNet-50, no weights, cut into pieces as ``--model torchvision:NAME``
is) with a slide-level pool head (``--pool attention`` by default, or ``max``), batch 1, one process and the
trunk on 2x2 and 2x4 tiles (plus the one layer rank that holds the pool head, as ``train --whole-slide`` lays it
out: ``--split-size 2 --spatial-size 1``) are each searched for the largest square canvas whose training step
fits ``--budget-mib`` on every rank. Each job is its own ``mpiexec`` (1, 5 and 9 processes).

What is measured: one full ``HybridEngine.train_step`` (forward, backward, SGD with momentum; recomputation with
``--recompute``, bf16 autocast with ``--bf16``) after a warm-up step, under the torch profiler's allocation
record (``measure.steps.measure_engine_step``: the bytes the rank holds in parameters, buffers, gradients and
optimizer state plus the most the step allocates on top; the planner's "measured peak"). Not RSS: glibc keeps
freed pages. A canvas fits when the largest rank's measured peak is within the budget. Every rank reads only
its tile of the canvas (``ShardedImages``; random pixels: memory does not depend on them).

Search (``support.whole_slide.largest_side``), on measured peaks only: a probe, then from every side that fits
the side the last two fitting sides predict (peak = fixed + bytes per pixel x pixels), at most double and at
least one canvas multiple more, until a side does not fit; then a bisection between the largest side that fits
and the smallest that does not (both measured). Sides are
multiples of the trunk's stride (32) times the tile grid's rows and columns (square canvas: 32, 64, 128).

    python benchmarks/bench_whole_slide_memory.py --budget-mib 256,448      # ResNet-18, -50: minutes on 2 cores
    python benchmarks/bench_whole_slide_memory.py --budget-mib 16384 --recompute --bf16   # a large node
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from support.launch import last_json, mpi_command
from support.machine import Footer
from support.tables import Table
from support.whole_slide import GRIDS, MIB, Found, canvas_multiple, largest_side, layout_name, processes, step_peaks
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.comm.launcher import rank_environment
from mpi4dl_nb.models.external import external_layers
from mpi4dl_nb.models.head import ClassifierHead
from mpi4dl_nb.models.pools import PoolKind

TRUNK_STRIDE = 32          # torchvision ResNets down-sample by 32
TRUNK_CHANNELS = {"resnet18": 512, "resnet50": 2048}
RESULT = "whole-slide-memory:"


@dataclass(frozen=True)
class Job:
    """One search: a trunk on ``tiles`` tile ranks (1: one process) with a pool head, under a per-rank budget."""

    trunk: str
    tiles: int
    pool: str
    budget_mib: float
    probe: int
    recompute: bool
    bf16: bool

    @property
    def grid(self) -> tuple[int, int] | None:
        return GRIDS[self.tiles]

    @property
    def processes(self) -> int:
        return processes(self.tiles)

    @property
    def multiple(self) -> int:
        """Square canvas sides must be multiples of this (every tile whole trunk strides)."""
        return canvas_multiple(self.tiles, TRUNK_STRIDE)

    @property
    def layout(self) -> str:
        return layout_name(self.tiles)

    def layers(self) -> list[nn.Module]:
        """torchvision's trunk without its average-pool head, then a 2-class head pooling as ``pool``."""
        torch.manual_seed(0)
        trunk = external_layers("torchvision", self.trunk, 2)[:-1]
        return [*trunk, ClassifierHead(TRUNK_CHANNELS[self.trunk], 2, pool=PoolKind(self.pool))]


def search(job: Job, measure: Callable[[int], list[int]], log: Callable[[str], None]) -> Found:
    """The largest side (a multiple of ``job.multiple``) whose largest measured peak is within the budget, from
    ``job.probe`` px (times sqrt(tiles) on tiles: as many pixels per rank)."""
    def heard(side: int, peak: int, fits: bool) -> None:
        log(f"  {job.trunk} on {job.layout}: {side} px -> {peak / MIB:.1f} MiB ({'fits' if fits else 'over'})")

    start = int(job.probe * math.sqrt(job.tiles))
    return largest_side(job.budget_mib * MIB, job.multiple, start, measure, heard)


def worker(job: Job) -> None:
    """One ``mpiexec`` job: the search on this world, the answer as a JSON line from rank 0."""
    torch.set_num_threads(1)
    ctx = dl.init()
    if ctx.world_size != job.processes:
        raise SystemExit(f"{job.layout} needs mpiexec -n {job.processes}; this job has {ctx.world_size}")
    say = (lambda text: print(text, flush=True)) if ctx.rank == 0 else (lambda text: None)
    found = search(job, lambda side: step_peaks(ctx, job.layers, job.tiles, side, recompute=job.recompute,
                                                bf16=job.bf16), say)
    say(f"{RESULT} {json.dumps(asdict(found))}")
    ctx.barrier()


def run_search(job: Job) -> Found:
    """Run ``job`` under ``mpiexec``, echoing each measured side as it comes; its answer."""
    command = mpi_command(job.processes, [sys.executable, __file__, "--worker", json.dumps(asdict(job))])
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=rank_environment(job.processes)) as process:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith(("  ", RESULT)):
                print(line.rstrip(), flush=True)
        code = process.wait()
    if code != 0:
        raise SystemExit(f"{' '.join(command)} failed (exit {code}):\n{''.join(lines[-40:])}")
    return Found(**last_json("".join(lines), RESULT))


def table(jobs: list[Job], found: list[Found]) -> str:
    one = {job.trunk: f.side ** 2 for job, f in zip(jobs, found) if job.tiles == 1}
    rows = Table(["trunk", ">budget MiB", ">tile ranks", "layout", ">largest canvas px", ">Mpx",
                  ">pixels vs one process", ">measured peak MiB per rank (largest)", ">layer rank MiB",
                  ">next side (over)", ">sides measured"])
    for job, f in zip(jobs, found):
        layer = f"{f.peaks[-1] / MIB:.0f}" if job.grid is not None else "-"
        rows.add(job.trunk, f"{job.budget_mib:g}", job.tiles, job.layout, f"{f.side}", f"{f.side ** 2 / 1e6:.2f}",
                 f"{f.side ** 2 / one[job.trunk]:.2f}x" if job.trunk in one else "-", f"{max(f.peaks) / MIB:.1f}",
                 layer, f.too_big or "-", f.measured)
    return rows.markdown()


def acceptance(jobs: list[Job], found: list[Found]) -> list[str]:
    """The issue's line per trunk: 4 tile ranks train >= 3.5x the pixels of one process at the same budget."""
    lines = []
    for trunk in dict.fromkeys(job.trunk for job in jobs):
        sides = {job.tiles: f.side for job, f in zip(jobs, found) if job.trunk == trunk}
        if 1 in sides and 4 in sides:
            ratio = (sides[4] / sides[1]) ** 2
            lines.append(f"{trunk}: 4 tile ranks {ratio:.2f}x the pixels of one process "
                         f"({'meets' if ratio >= 3.5 else 'MISSES'} the goal >= 3.5x)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", default="256,448",
                        help="measured peak per rank (MiB): one for every trunk, or one per trunk (in order)")
    parser.add_argument("--trunks", default="resnet18,resnet50", help="torchvision ResNets, comma-separated")
    parser.add_argument("--tiles", default="1,4,8", help="tile ranks: 1 (one process), 4 (2x2), 8 (2x4)")
    parser.add_argument("--pool", default="attention", choices=["attention", "max"])
    parser.add_argument("--probe", type=int, default=256,
                        help="first side measured by one process (px; x sqrt(tiles) on tiles)")
    parser.add_argument("--recompute", action="store_true", help="checkpoint_activations='every'")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (float32 weights)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)   # a Job as JSON: run one search under mpiexec
    args = parser.parse_args()
    if args.worker:
        worker(Job(**json.loads(args.worker)))
        return
    footer = Footer()
    trunks = [t.strip() for t in args.trunks.split(",") if t.strip()]
    tiles = [int(t) for t in args.tiles.split(",")]
    for name, wrong in (("--trunks", [t for t in trunks if t not in TRUNK_CHANNELS]),
                        ("--tiles", [t for t in tiles if t not in GRIDS])):
        if wrong:
            raise SystemExit(f"{name}: {wrong} unknown; choose from "
                             f"{', '.join(map(str, TRUNK_CHANNELS if name == '--trunks' else GRIDS))}")
    budgets = [float(b) for b in args.budget_mib.split(",")]
    if len(budgets) not in (1, len(trunks)):
        raise SystemExit(f"--budget-mib: {len(budgets)} budgets for {len(trunks)} trunks; give one or one per trunk")
    budget_of = dict(zip(trunks, budgets * len(trunks) if len(budgets) == 1 else budgets))
    jobs = [Job(trunk, n, args.pool, budget_of[trunk], args.probe, args.recompute, args.bf16)
            for trunk in trunks for n in tiles]
    print(f"whole-slide training step, --pool {args.pool}, batch 1, SGD with momentum, "
          f"{'bf16' if args.bf16 else 'fp32'}{', recomputation' if args.recompute else ''}; budget per rank "
          f"(measured, allocation profiler): {', '.join(f'{t} {b:g} MiB' for t, b in budget_of.items())}",
          flush=True)
    found = [run_search(job) for job in jobs]
    print("\n" + table(jobs, found))
    print("\n".join(acceptance(jobs, found)))
    footer.print()


if __name__ == "__main__":
    main()
