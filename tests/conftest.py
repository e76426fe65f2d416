"""Shared pytest set-up: the MPI harness as a fixture."""

from __future__ import annotations

import pytest

from tests.support.mpirun import run_mpi


@pytest.fixture
def mpirun():
    """``mpirun(n, script, *args, timeout=...)`` runs tests/mpi/<script>.py on n ranks."""
    return run_mpi
