"""Long runs through the Python API keep flat memory: the trace stays a bounded window, per-rank RSS
and live tensor bytes do not grow with the step count, on both data planes (issues 17 and 54;
benchmarks/bench_soak.py runs the long version: every rank's RSS between steps 2,000 and 10,000)."""

from __future__ import annotations

import pytest

from tests.mpi.soak import check_names


@pytest.mark.parametrize("plane", ["mpi", "gloo"])
def test_sp_lp_soak_keeps_trace_and_memory_flat(mpirun, plane):
    backend = () if plane == "mpi" else ("--backend=gloo",)
    mpirun(5, "soak", "sp_lp", 160, *backend, timeout=400, checks=check_names())
