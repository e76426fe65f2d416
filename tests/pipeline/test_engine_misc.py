"""HybridEngine behaviour beyond exactness: errors, step-through hook, timeline, loud failure."""

from __future__ import annotations

import pytest

from tests.mpi.engine_misc import CHECKS


@pytest.mark.parametrize("name", CHECKS)
def test_errors_hook_grads_and_timeline(mpi_checks, name):
    mpi_checks(3, "engine_misc", timeout=180).require([name])


def test_failure_on_one_rank_aborts_the_job(mpirun):
    result = mpirun(2, "engine_fail", timeout=120, expect_failure=True)
    assert "deliberate failure in stage 1" in result.stdout
    assert "unreachable" not in result.stdout
