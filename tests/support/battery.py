"""Shared launches: MPI test programs registered by world size and plane run in one ``mpiexec``.

Starting a rank costs ~4.6 CPU-seconds before any test work (``import torch``, then
``torch._dynamo``, which the first optimizer imports): 9 ranks on 2 cores take ~25 s. So a
test module registers each program run it needs at import (``shared_job``), and the first
test that asks for one (the ``shared_launch`` fixture in tests/conftest.py) runs every job
registered for that world size and plane, one after the other, in one launch
(tests/mpi/battery.py). A job running past its own ``timeout`` aborts the launch, naming
itself; the launch's limit is the sum of its jobs'. Each job's checks carry its label;
``job_report`` gives a test the report of its job alone, as if the job had run by itself:

* its named checks, without the label;
* a job error only when the job did not end well on every rank: it raised outside its
  checks, or the launch was aborted, killed or timed out before the job ended. A later
  job's failure is not this job's.

Every job starts from the torch random state its rank's process started with. Jobs of one
launch share one process per rank, so one ``dl.init`` backend: the plane (``mpi`` or
``gloo``) is part of the launch's key. Programs that measure memory (RSS), take files made by
a fixture, need their own environment, or close the torch plane keep their own launch
(``mpirun`` / ``mpi_checks``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from .checks import CheckReport

Plane = Literal["mpi", "gloo"]
END = "(job ran to its end)"   # the check each job reports when its program returns


@dataclass(frozen=True)
class Job:
    """One run of ``tests/mpi/<program>.py`` with ``args`` on ``nprocs`` ranks of ``plane``."""

    nprocs: int
    plane: Plane
    program: str
    args: tuple[str, ...]
    timeout: float

    @property
    def label(self) -> str:
        return job_label(self.program, self.args)

    @property
    def prefix(self) -> str:
        return check_prefix(self.program, self.args)

    @property
    def launch(self) -> tuple[int, Plane]:
        return self.nprocs, self.plane


def job_label(program: str, args: Sequence[str]) -> str:
    return " ".join((program, *args))


def check_prefix(program: str, args: Sequence[str]) -> str:
    """What a job's check names start with in the launch's output."""
    return f"[{job_label(program, args)}] "


REGISTERED: dict[tuple[int, Plane], list[Job]] = {}


def shared_job(nprocs: int, program: str, *args: object, plane: Plane = "mpi", timeout: float = 300) -> Job:
    """Register a run of ``program`` for the shared launch of ``nprocs`` ranks on ``plane``."""
    job = Job(nprocs, plane, program, tuple(map(str, args)), timeout)
    jobs = REGISTERED.setdefault(job.launch, [])
    if job not in jobs:
        jobs.append(job)
    return job


def encode(jobs: list[Job]) -> str:
    """The jobs as tests/mpi/battery.py reads them: [program, timeout, *args] each."""
    return json.dumps([[job.program, job.timeout, *job.args] for job in jobs])


def job_report(report: CheckReport, job: Job) -> CheckReport:
    """The part of a shared launch's ``report`` that is ``job``'s (see the module docstring)."""
    own = [replace(r, name=r.name[len(job.prefix):]) for r in report.results if r.name.startswith(job.prefix)]
    ends = [r for r in own if r.name == END]
    raised = [r for r in ends if not r.passed]
    if raised:
        error: str | None = f"raised outside its checks: {raised[0]}"
    elif len({r.rank for r in ends}) < job.nprocs:
        error = f"did not end on every rank ({report.job_error or 'the launch went on'})"
    else:
        error = None
    command = f"{report.command} (job {job.label!r})"
    return CheckReport([r for r in own if r.name != END], error, report.output, command)
