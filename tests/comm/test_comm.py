"""Both data planes on 2 and 4 real MPI ranks."""

import pytest


@pytest.mark.parametrize("nprocs", [2, 4])
def test_data_planes(mpirun, nprocs):
    result = mpirun(nprocs, "comm_planes", timeout=120)
    assert f"comm_planes ok on {nprocs} ranks" in result.stdout
