"""The cost of one meeting of a tile group, measured on the job, next to the time model's.

    OMP_NUM_THREADS=1 MPIR_CVAR_ENABLE_HEAVY_YIELD=1 mpiexec -n 5 python benchmarks/bench_meetings.py

A spatial stage's tiles meet at every halo exchange and BatchNorm sum. Here groups of ranks do
rounds of work with a small all-reduce after each (``measure.calibration.meeting_cost``, the rest of the
ranks waiting): 2 ranks, 3, 4, all of them, and two pairs at once (GEMS's two tile groups), with
short and long work between meetings. Printed per group: the measured seconds per meeting, the
model's (``Network.meeting`` and ``Crowding.meeting_extra`` plus the sum's bytes, ``Network.reduction_bytes``) and the
earlier model's (``Network.meeting`` plus a ring all-reduce's latency and bytes,
``Network.all_reduce``), each as a ratio to measured. The model's figure for two pairs leaves out
the crowding by the other pair, which the simulator adds in proportion to the ranks computing.

A second table times what a spatial stage's tiles do between and at their meetings: each round,
a group of ranks runs conv layers' forward and backward (``measure.calibration.layer_work``; about 1 and
4 ms per round timed on one rank alone) and then meets, the rest of the ranks waiting. Printed:
the measured seconds per round next to the simulator's (``planner.simulate``: the tiles as one
lockstep group with that work and one meeting (``Crowding.meeting_extra``) per round, beside the waiting ranks), and
the simulator's before more tiles than cores were slowed by the waiting ranks in all their time.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch
from support.machine import Footer
from support.tables import Table

import mpi4dl_nb as dl
from mpi4dl_nb.comm.protocol import Comm
from mpi4dl_nb.comm.waiting import node_cores
from mpi4dl_nb.config import ParallelConfig
from mpi4dl_nb.measure.calibration import LONG_WORK, SHORT_WORK, calibrate_job, layer_work, meeting_cost
from mpi4dl_nb.pipeline.actions import ActionKind
from mpi4dl_nb.pipeline.schedules import build_schedule
from mpi4dl_nb.planner.simulate import Cost, group_key, simulate
from mpi4dl_nb.planner.step_time import tile_cost
from mpi4dl_nb.planner.timing import Network, network_of

FLAG_BYTES = 4


def groups_of(world: int) -> dict[str, list[tuple[int, ...]]]:
    """The groups measured on ``world`` ranks, by name."""
    found = {"2 ranks": [(0, 1)]}
    found.update({f"{size} ranks": [tuple(range(size))] for size in range(3, world)})
    found[f"all {world}"] = [tuple(range(world))]
    if world >= 4:
        found["two pairs at once"] = [(0, 1), (world - 2, world - 1)]
    return found


def alone_seconds(ctx: Comm, work: Callable[[], None], repeats: int = 20) -> float:
    """Seconds of one ``work`` on rank 0 while the other ranks sleep (as the planner times layers)."""
    seconds = None
    if ctx.rank == 0:
        work()
        start = time.perf_counter()
        for _ in range(repeats):
            work()
        seconds = (time.perf_counter() - start) / repeats
    else:
        time.sleep(1.0)
    return float(ctx.bcast_object(seconds, root=0))


def round_seconds(ctx: Comm, members: int, work: Callable[[], None], count: int, rounds: int,
                  repeats: int) -> float:
    """Best seconds per round of ``count`` works and a small all-reduce on ranks ``0..members-1``,
    the other ranks waiting (collective; every rank gets it)."""
    group = ctx.new_group(tuple(range(members)))
    flag = torch.zeros(1)
    best = math.inf
    for _ in range(repeats):
        ctx.barrier()
        start = time.perf_counter()
        if ctx.rank < members:
            for _ in range(rounds):
                for _ in range(count):
                    work()
                ctx.all_reduce(flag, group=group)
        ctx.barrier()
        best = min(best, time.perf_counter() - start)
    return float(ctx.bcast_object(best / rounds, root=0))


def modelled_round(network: Network, members: int, world: int, cores: int, work: float,
                   earlier: bool = False) -> float:
    """The simulator's seconds per round: ``members`` tiles in lockstep (one stage), ``work`` each
    and one meeting, beside the ``world - members`` ranks of the stages after them waiting.
    ``earlier``: as the simulator had it before tiles outnumbering the cores were slowed by the
    waiting ranks in all their time - only in their exposed share (computing, not meeting)."""
    cfg = ParallelConfig(split_size=1 + world - members, spatial_size=1, num_spatial_parts=members,
                         slice_method="horizontal")
    wire = network.reduction_bytes(FLAG_BYTES, members)
    slowdown = network.crowding.waiting_slowdown
    if earlier and members > cores:     # the exposed share folded into the slowdown, as it was applied
        # (such a group's own exposed share no longer counts: the simulator slows it in all its time)
        share = tile_cost(network, None, members, work, wire, 1, cores, world, network.crowding).exposed
        slowdown = 1.0 + (slowdown - 1.0) * share

    def cost(action):
        if action.kind is ActionKind.FORWARD and action.stage == 0:
            return tile_cost(network, group_key(action, tuple(range(members)), "tiles"), members, work, wire, 1,
                             cores, world, network.crowding)
        return Cost()
    timelines = simulate(build_schedule(cfg), cost, lambda action: 0.0, cores=cores, waiting_slowdown=slowdown)
    return timelines[0].phases[ActionKind.FORWARD.value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60, help="meetings per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs with and without meetings (best of each)")
    args = parser.parse_args()
    if args.rounds < 1 or args.repeats < 1:
        parser.error("--rounds and --repeats must be at least 1")
    footer = Footer()
    ctx = dl.init()
    if ctx.world_size < 3:
        parser.error("run on at least 3 ranks (mpiexec -n 5 for the table in BENCHMARKS.md)")
    network = network_of(calibrate_job(ctx))
    cores = node_cores()
    rows = []
    for work in (SHORT_WORK, LONG_WORK):
        for name, groups in groups_of(ctx.world_size).items():
            measured = meeting_cost(ctx, rounds=args.rounds, work_seconds=work, repeats=args.repeats, groups=groups)
            members = len(groups[0])
            model = network.meeting + network.crowding.meeting_extra(members, work, cores, ctx.world_size) + \
                network.reduction_bytes(FLAG_BYTES, members)
            earlier = network.meeting + network.all_reduce(FLAG_BYTES, members)
            rows.append((work, name, measured, model, earlier))
    unit = layer_work(side=32, batch=1)
    alone = alone_seconds(ctx, unit)
    layer_rows = []
    for count in (1, 4):
        for members in (2, *range(cores + 1, ctx.world_size)):
            rounds = max(10, round(0.3 / (count * alone * max(1.0, members / cores))))
            measured = round_seconds(ctx, members, unit, count, rounds, args.repeats)
            layer_rows.append((count * alone, members, measured,
                               *(modelled_round(network, members, ctx.world_size, cores, count * alone, earlier)
                                 for earlier in (False, True))))
    if ctx.rank != 0:
        return
    print(f"{ctx.world_size} ranks on {cores} cores; network: {network.describe()}\n")
    table = Table(["work between meetings", "group", ">measured ms", ">model ms (ratio)", ">earlier model ms (ratio)"])
    for work, name, measured, model, earlier in rows:
        table.add(f"{work * 1e3:.2f} ms", name, f"{measured * 1e3:.3f}", f"{model * 1e3:.3f} ({model / measured:.2f})",
                  f"{earlier * 1e3:.3f} ({earlier / measured:.2f})")
    print(table.markdown())
    print(f"\nlayer work and a meeting per round ({alone * 1e3:.2f} ms per work alone), "
          f"the other ranks waiting:\n")
    table = Table(["work per round (alone)", "group", ">measured ms per round", ">model ms (ratio)",
                   ">earlier model ms (ratio)"])
    for work, members, measured, model, earlier in layer_rows:
        table.add(f"{work * 1e3:.2f} ms", f"{members} ranks", f"{measured * 1e3:.3f}",
                  f"{model * 1e3:.3f} ({model / measured:.2f})", f"{earlier * 1e3:.3f} ({earlier / measured:.2f})")
    print(table.markdown())
    footer.print()

if __name__ == "__main__":
    main()
