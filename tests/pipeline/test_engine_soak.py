"""Long runs through the Python API keep flat memory: the trace stays a bounded window, per-rank RSS
and live tensor bytes do not grow with the step count (issue 17; benchmarks/bench_soak.py runs the
long version, on both data planes: ``--backend mpi|gloo --from-step N``). The gloo plane is not
checked here: its tile ranks' anonymous RSS still grows ~20 KB/step over steps 40-160 (issue 54)."""

from __future__ import annotations

from tests.mpi.soak import check_names


def test_sp_lp_soak_keeps_trace_and_memory_flat(mpirun):
    mpirun(5, "soak", "sp_lp", 160, timeout=400, checks=check_names())
