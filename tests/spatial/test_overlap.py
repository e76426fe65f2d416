"""Halo overlap and region convs/pools (strided, dilated, max/avg pools, ceil_mode) equal serial, on both planes."""

from __future__ import annotations

import pytest

from tests.mpi import halo_overlap


@pytest.mark.parametrize("backend", ["auto", "gloo"])
def test_overlap_and_regions_equal_serial(mpirun, backend):
    mpirun(4, "halo_overlap", f"--backend={backend}", timeout=200,
           checks=halo_overlap.check_names())
