"""Long runs through the Python API keep flat memory: the trace stays a bounded window, per-rank RSS
and live tensor bytes do not grow with the step count (issue 17; benchmarks/bench_soak.py runs the
long version, on both data planes: ``--backend mpi|gloo --from-step N``). Heap in use (glibc's bytes handed out,
whoever allocated them) is checked beside RSS: it catches a per-step record below Python. The gloo plane is not
checked here: there torch's collective flight recorder fills its ring of 2000 entries (~1 KB each) for the first
2000 collectives: the layer rank's first 1,000-2,000 steps (issue 54; bounded, torch's default, kept)."""

from __future__ import annotations

from tests.mpi.soak import check_names


def test_sp_lp_soak_keeps_trace_and_memory_flat(mpirun):
    mpirun(5, "soak", "sp_lp", 160, timeout=400, checks=check_names())
