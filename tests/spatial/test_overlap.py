"""Halo overlap and region convs/pools (strided, dilated, max/avg pools, ceil_mode) equal serial, on both planes."""

from __future__ import annotations

import pytest

from tests.mpi import halo_overlap
from tests.support.battery import shared_job

JOBS = {"auto": shared_job(4, "halo_overlap", "--backend=auto", timeout=200),
        "gloo": shared_job(4, "halo_overlap", "--backend=gloo", plane="gloo", timeout=200)}


@pytest.mark.parametrize("backend", list(JOBS))
def test_overlap_and_regions_equal_serial(shared_launch, backend):
    shared_launch(JOBS[backend]).require_clean(halo_overlap.check_names())
