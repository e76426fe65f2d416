"""Halo overlap (banded convs computing the owned tile while row halos fly) is exact, on both planes."""

from __future__ import annotations

import pytest

CHECKS = ["overlap 2x1", "overlap 1x2"]


@pytest.mark.parametrize("backend", ["auto", "gloo"])
def test_overlap_equals_plain_order_and_serial(mpirun, backend):
    mpirun(2, "halo_overlap", f"--backend={backend}", timeout=200, checks=CHECKS)
