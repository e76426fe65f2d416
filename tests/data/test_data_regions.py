"""Under mpiexec, spatial ranks read only their tile box of each whole-slide tile (tests/mpi/models_regions.py)."""
from __future__ import annotations

import pytest

from tests.mpi.models_regions import LOSS, READS
from tests.support.battery import shared_job

tifffile = pytest.importorskip("tifffile")
JOB = shared_job(5, "models_regions")


def test_spatial_ranks_read_only_their_region(shared_launch):
    report = shared_launch(JOB)
    report.require_clean([READS, LOSS])
    assert {r.rank for r in report.results} == set(range(5))   # every rank checked itself
