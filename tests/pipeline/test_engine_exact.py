"""HybridEngine == serial training (float64) for every LP/PP/GEMS/SP/DP mix, under mpiexec.

One mpiexec launch per world size runs all cases of that size (see tests/support/engine_cases.py).
"""

from __future__ import annotations

import pytest

from tests.support.engine_cases import CASES, cases_by_world_size, config_of

GROUPS = cases_by_world_size()


@pytest.mark.parametrize("nprocs", sorted(GROUPS))
def test_engine_matches_serial(mpirun, nprocs):
    names = GROUPS[nprocs]
    result = mpirun(nprocs, "engine_exact", *names, timeout=400)
    for name in names:
        assert f"OK {name}:" in result.stdout, result.stdout
    assert "OK round trip" in result.stdout


def test_acceptance_cases_are_covered():
    """Every configuration the issue lists has a case."""

    def has(pred) -> bool:
        return any(pred(config_of(n)) for n in CASES)

    assert has(lambda c: c.split_size == 2 and c.spatial_size == 0 and c.parts == 1 and not c.gems)
    assert has(lambda c: c.split_size == 3 and c.spatial_size == 0 and c.parts == 1 and not c.gems)
    for kind in ("gpipe", "1f1b"):
        for m in (2, 4):
            assert has(lambda c, m=m, kind=kind: c.spatial_size == 0 and c.parts == m and c.schedule == kind
                       and not c.gems and c.local_dp == 1 and c.data_parallel == 1)
    for t in (1, 2):
        assert has(lambda c, t=t: c.times == t and c.spatial_size == 0)
    for method in ("square", "vertical", "horizontal"):
        assert has(lambda c, method=method: c.split_size == 2 and c.spatial_size == 1 and c.num_spatial_parts == 4
                   and c.slice_method == method and c.parts == 1 and not c.gems)
    assert has(lambda c: c.split_size == 3 and c.spatial_size == 2)
    assert has(lambda c: c.spatial_size > 0 and c.parts > 1 and not c.gems)
    assert has(lambda c: c.spatial_size > 0 and c.gems and c.parts == 1)
    assert has(lambda c: c.spatial_size > 0 and c.gems and c.parts > 1)
    assert has(lambda c: c.local_dp == 2)
    assert has(lambda c: c.data_parallel == 2 and c.spatial_size > 0)


def test_engine_on_torch_distributed_plane(mpirun):
    """Same exactness with tensors on torch.distributed (gloo) instead of mpi4py."""
    result = mpirun(2, "engine_exact", "--backend=gloo", "gems_pp", "pp2_gpipe_m4", timeout=300)
    assert "OK gems_pp:" in result.stdout and "OK pp2_gpipe_m4:" in result.stdout
