"""How a rank waits, side by side: the same training steps with the mpi plane blocking in MPI and yielding.

    OMP_NUM_THREADS=1 MPIR_CVAR_ENABLE_HEAVY_YIELD=1 mpiexec -n 3 python benchmarks/bench_wait.py
    OMP_NUM_THREADS=1 MPIR_CVAR_ENABLE_HEAVY_YIELD=1 mpiexec -n 5 python benchmarks/bench_wait.py

Two Contexts on the same MPI world, one per ``WaitMode`` (``comm/waiting.py``); for every
configuration of this world size (ResNet-20 v2 width 8, 256 px, as in ``bench_planner.py``)
one engine per mode, rounds alternating between them (``--rounds`` of ``--steps`` timed steps,
each started at a barrier; a step's time is the slowest rank's). Prints the median step of
each mode and the speed-up of yielding. With more ranks than cores a blocked MPI wait polls
and keeps a core from the ranks that compute; with a core per rank the two should tie.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from support.machine import Footer
from support.tables import Table
from torch import nn

from mpi4dl_nb import ParallelConfig
from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.comm.waiting import WaitMode, node_cores
from mpi4dl_nb.measure.steps import time_engine_steps
from mpi4dl_nb.measure.trials import ModelSpec
from mpi4dl_nb.pipeline.engine import HybridEngine

CASES = {
    3: [("SP2v+LP", dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical"), 2),
        ("LP3, GPipe m=2", dict(split_size=3, spatial_size=0, parts=2), 2),
        ("LP3 GEMS", dict(split_size=3, spatial_size=0, times=1), 2)],
    5: [("SP4+LP", dict(split_size=2, spatial_size=1, num_spatial_parts=4), 2),
        ("SP4+LP, 2 micro-batches", dict(split_size=2, spatial_size=1, num_spatial_parts=4, parts=2), 4)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=20)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    footer = Footer()
    torch.set_num_threads(1)
    contexts = {mode: Context(wait=mode.value) for mode in WaitMode}
    world = contexts[WaitMode.BLOCK].world_size
    spec = ModelSpec("resnet", args.depth, args.width, num_classes=2)
    rank0 = contexts[WaitMode.BLOCK].rank == 0
    if rank0:
        print(f"{world} ranks on {node_cores()} cores, ResNet-{args.depth} v2 w{args.width} {args.image_size} px; "
              f"median step (slowest rank), {args.rounds} rounds x {args.steps} steps per mode")
    table = Table([f"configuration (ResNet-{args.depth} v2 w{args.width}, {args.image_size} px)", ">block s",
                   ">yield s", ">yield speed-up"])
    for name, knobs, batch in CASES.get(world, []):
        images, labels = spec.batch(args.image_size, batch)
        engines = {mode: HybridEngine(spec.build(), ParallelConfig(**knobs), ctx, loss_fn=nn.CrossEntropyLoss(),
                                      optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
                   for mode, ctx in contexts.items()}
        times: dict[WaitMode, list[float]] = {mode: [] for mode in WaitMode}
        for round_ in range(args.rounds):
            for mode, engine in engines.items():
                mine = time_engine_steps(engine, images, labels, steps=args.steps, warmup=1 if round_ == 0 else 0)
                everyone = contexts[mode].all_gather_object(mine)
                times[mode] += [max(step) for step in zip(*everyone)]
        if rank0:
            block, yielded = (statistics.median(times[m]) for m in (WaitMode.BLOCK, WaitMode.YIELD))
            table.add(name, f"{block:.3f}", f"{yielded:.3f}", f"{block / yielded:.2f}x")
            print(f"  {name}: done", file=sys.stderr, flush=True)
    if rank0 and world not in CASES:
        print(f"no configurations for {world} ranks: run with 3 or 5")
    elif rank0:
        print(table.markdown())
        footer.print()


if __name__ == "__main__":
    main()
