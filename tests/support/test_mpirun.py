"""The MPI test harness reports a failing rank's traceback and kills a hung job."""

import time

import pytest

from tests.support.mpirun import MPIRunError, run_mpi


def test_failing_rank_reports_its_traceback():
    with pytest.raises(MPIRunError) as info:
        run_mpi(3, "harness_probe", "fail", timeout=60)
    text = str(info.value)
    assert "failed with exit code" in text
    assert "RuntimeError: deliberate failure on rank 1" in text
    assert "[1]" in text  # output lines carry the rank prefix


def test_hang_is_killed_and_reported():
    start = time.monotonic()
    with pytest.raises(MPIRunError, match="timed out after 5s and was killed"):
        run_mpi(2, "harness_probe", "hang", timeout=5)
    assert time.monotonic() - start < 30
