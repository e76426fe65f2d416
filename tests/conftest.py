"""Shared pytest set-up: the MPI launcher as fixtures (one launch per job, shared by a module's tests)."""

from __future__ import annotations

import pytest

from tests.support.checks import CheckReport
from tests.support.mpirun import launch_mpi, run_mpi


@pytest.fixture
def mpirun():
    """``mpirun(n, program, *args, timeout=..., checks=[names])`` runs tests/mpi/<program>.py on n
    ranks and raises on any failed or missing check (``module=True``: ``python -m program``)."""
    return run_mpi


@pytest.fixture(scope="module")
def mpi_checks():
    """``mpi_checks(n, program, *args, timeout=...)``: the CheckReport of one launch, run once per
    argument list and shared by the module's tests, so each test can require its own named checks
    (``report.require([name])``) without paying for another launch."""
    reports: dict[tuple, CheckReport] = {}

    def launch(nprocs: int, program: str, *args: object, timeout: float = 180) -> CheckReport:
        key = (nprocs, program, *map(str, args))
        if key not in reports:
            reports[key] = launch_mpi(nprocs, program, *args, timeout=timeout).checks
        return reports[key]

    return launch
