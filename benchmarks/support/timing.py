"""Timing helpers: best or median of repeated runs, the slowest rank's figure, configurations timed in turns."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

from mpi4dl_nb.comm.protocol import Comm


def seconds_of(run: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def best_of(run: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls (a shared machine's slow spells only ever add time)."""
    return min(seconds_of(run) for _ in range(repeats))


def median_of(run: Callable[[], object], repeats: int, ctx: Comm | None = None) -> float:
    """The median of ``repeats`` calls, each started at a barrier when ``ctx`` is given."""
    times = []
    for _ in range(repeats):
        if ctx is not None:
            ctx.barrier()
        times.append(seconds_of(run))
    return statistics.median(times)


def slowest_rank(ctx: Comm, seconds: float) -> float:
    """The largest of every rank's figure (collective): the slowest rank sets a collective step's time."""
    return max(ctx.all_gather_object(seconds))


def in_turns(ctx: Comm, runs: Mapping[str, Callable[[], object] | None], rounds: int) -> dict[str, float]:
    """Median seconds per call of every run, one call of each in turn per round after a warm-up round, each
    started and ended at a barrier so load on a shared machine hits them alike. A run that is ``None`` on
    this rank waits at the barriers while the others work (a one-process run on rank 0)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for index in range(rounds + 1):
        for name, run in runs.items():
            ctx.barrier()
            start = time.perf_counter()
            if run is not None:
                run()
            ctx.barrier()
            if index:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(found) for name, found in times.items()}
