"""What each test costs (a pytest plugin, not loaded by default): ``pytest -p tests.support.cost_plugin ...``.

For each test it records the CPU seconds of the test process and of the children it waited for (``getrusage``:
CLI runs, ``mpiexec`` with every rank), the wall seconds, and the machine's busy CPU seconds over the test
(``/proc/stat``: counts what runs beside it, so read it on a quiet machine); at the end it writes them, costliest
first, tab-separated, to ``MPI4DL_TEST_COSTS`` (default ``out/test-costs.tsv``) and prints the totals. A shared
launch's cost lands on the test that ran it; each of its jobs' own CPU per rank and peak RSS (their END check's
detail, tests/mpi/battery.py) go to the same path with ``.jobs.tsv`` for ``.tsv``, costliest first.
"""

from __future__ import annotations

import os
import re
import resource
import time
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Cost:
    """One test's CPU seconds (itself and its waited-for children), wall seconds and machine busy seconds."""

    cpu: float
    wall: float
    busy: float
    test: str


COSTS: list[Cost] = []
JOBS: list[tuple[float, str, int, str]] = []     # (CPU-s, job label, rank, its END detail)
CPU = re.compile(r"cpu ([\d.]+)s")


def note_launch(results: Iterable[tuple[str, int, str]], end: str) -> None:
    """Keep the CPU of each (check name, rank, detail) of a shared launch whose name ends with ``end``."""
    for name, rank, detail in results:
        found = CPU.search(detail)
        if name.endswith(end) and found:
            JOBS.append((float(found.group(1)), name[:-len(end)].strip(" []"), rank, detail))


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of every child it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def machine_busy_seconds() -> float:
    """CPU seconds the machine spent busy since boot (all cores; idle and I/O wait left out)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / TICKS


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    cpu, wall, busy = own_cpu_seconds(), time.monotonic(), machine_busy_seconds()
    yield
    COSTS.append(Cost(own_cpu_seconds() - cpu, time.monotonic() - wall, machine_busy_seconds() - busy, item.nodeid))


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = Path(os.environ.get("MPI4DL_TEST_COSTS", REPO / "out" / "test-costs.tsv"))
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = sorted(COSTS, key=lambda cost: cost.cpu, reverse=True)
    path.write_text("cpu_s\twall_s\tmachine_busy_s\ttest\n" + "".join(
        f"{c.cpu:.1f}\t{c.wall:.1f}\t{c.busy:.1f}\t{c.test}\n" for c in rows))
    if JOBS:
        jobs = path.with_name(path.name.removesuffix(".tsv") + ".jobs.tsv")
        jobs.write_text("cpu_s\trank\tjob\tdetail\n" + "".join(
            f"{cpu:.1f}\t{rank}\t{label}\t{detail}\n" for cpu, label, rank, detail in sorted(JOBS, reverse=True)))
    print(f"\n{len(rows)} tests: {sum(c.cpu for c in rows):.0f} CPU-s, {sum(c.wall for c in rows):.0f} s, the machine "
          f"busy {sum(c.busy for c in rows):.0f} CPU-s; each test in {path}")
