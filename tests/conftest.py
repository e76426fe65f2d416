"""Shared pytest set-up: repo on sys.path, one torch thread, the MPI harness as a fixture."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.fixture
def mpirun():
    """``mpirun(n, script, *args, timeout=...)`` runs tests/mpi/<script>.py on n ranks."""
    from mpirun import run_mpi

    return run_mpi
