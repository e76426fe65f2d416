"""The cost of one meeting of a tile group, measured on the job, next to the time model's.

    OMP_NUM_THREADS=1 MPIR_CVAR_ENABLE_HEAVY_YIELD=1 mpiexec -n 5 .venv/bin/python benchmarks/bench_meetings.py

A spatial stage's tiles meet at every halo exchange and BatchNorm sum. Here groups of ranks do
rounds of work with a small all-reduce after each (``run.measure.meeting_cost``, the rest of the
ranks waiting): 2 ranks, 3, 4, all of them, and two pairs at once (GEMS's two tile groups), with
short and long work between meetings. Printed per group: the measured seconds per meeting, the
model's (``Network.group_meeting`` plus the sum's bytes, ``Network.reduction_bytes``) and the
earlier model's (``Network.meeting`` plus a ring all-reduce's latency and bytes,
``Network.all_reduce``), each as a ratio to measured. The model's figure for two pairs leaves out
the crowding by the other pair, which the simulator adds in proportion to the ranks computing.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import mpi4dl_nb as dl  # noqa: E402
from mpi4dl_nb.comm.waiting import node_cores  # noqa: E402
from mpi4dl_nb.notebook.planner.timing import network_of  # noqa: E402
from mpi4dl_nb.run.measure import LONG_WORK, SHORT_WORK, calibrate_job, meeting_cost  # noqa: E402

FLAG_BYTES = 4


def groups_of(world: int) -> dict[str, list[tuple[int, ...]]]:
    """The groups measured on ``world`` ranks, by name."""
    found = {"2 ranks": [(0, 1)]}
    found.update({f"{size} ranks": [tuple(range(size))] for size in range(3, world)})
    found[f"all {world}"] = [tuple(range(world))]
    if world >= 4:
        found["two pairs at once"] = [(0, 1), (world - 2, world - 1)]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60, help="meetings per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs with and without meetings (best of each)")
    args = parser.parse_args()
    if args.rounds < 1 or args.repeats < 1:
        parser.error("--rounds and --repeats must be at least 1")
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
            model = network.group_meeting(members, work, cores, ctx.world_size) + \
                network.reduction_bytes(FLAG_BYTES, members)
            earlier = network.meeting + network.all_reduce(FLAG_BYTES, members)
            rows.append((work, name, measured, model, earlier))
    if ctx.rank != 0:
        return
    print(f"{ctx.world_size} ranks on {cores} cores; network: {network.describe()}\n")
    print("| work between meetings | group | measured ms | model ms (ratio) | earlier model ms (ratio) |")
    print("|---|---|---:|---:|---:|")
    for work, name, measured, model, earlier in rows:
        print(f"| {work * 1e3:.2f} ms | {name} | {measured * 1e3:.3f} | {model * 1e3:.3f} ({model / measured:.2f}) | "
              f"{earlier * 1e3:.3f} ({earlier / measured:.2f}) |")


if __name__ == "__main__":
    main()
