"""Both data planes on 2 and 4 real MPI ranks."""

import pytest

from tests.mpi.comm_planes import check_names


@pytest.mark.parametrize("nprocs", [2, 4])
def test_data_planes(mpirun, nprocs):
    mpirun(nprocs, "comm_planes", timeout=120, checks=check_names())
