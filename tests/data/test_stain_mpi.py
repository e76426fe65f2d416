"""Under mpiexec (5 ranks, SP+LP, float64), ``train --stain-normalize`` equals one process on whole normalised images:
Macenko on slides, Reinhard on the IHC sample (checks of the shared launch of tests/mpi/models_regions.py)."""
from __future__ import annotations

import pytest

from tests.mpi.models_regions import STAIN_CHECKS
from tests.support.battery import shared_job

tifffile = pytest.importorskip("tifffile")
JOB = shared_job(5, "models_regions")


def test_stain_normalised_training_equals_one_process(shared_launch):
    report = shared_launch(JOB)
    report.require_clean(STAIN_CHECKS)
    assert {r.rank for r in report.results if r.name in STAIN_CHECKS} == set(range(5))   # every rank checked
