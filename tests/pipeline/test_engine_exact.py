"""HybridEngine == serial training (float64) for every LP/PP/GEMS/SP/DP mix, under mpiexec.

One job per world size runs all cases of that size (see tests/support/engine_cases.py), in the
shared launch of that size (tests/support/battery.py); each case is its own test, reading its
named check from the job's report.
"""

from __future__ import annotations

import pytest

from tests.mpi.engine_exact import copies_name, round_trip_name
from tests.support.battery import shared_job
from tests.support.engine_cases import CASES, cases_by_world_size, config_of, random_cases

GROUPS = cases_by_world_size()
RANDOM_PER_SIZE = {2: 2, 3: 2, 4: 2, 5: 2, 6: 2}    # 10 random configurations in all (fixed seeds)
RANDOM = {size: list(random_cases(size, count)) for size, count in RANDOM_PER_SIZE.items()}


JOBS = {size: shared_job(size, "engine_exact", *names,
                         *([f"--random={RANDOM_PER_SIZE[size]}"] if size in RANDOM_PER_SIZE else []), timeout=600)
        for size, names in GROUPS.items()}
TORCH_PLANE_CASES = ["gems_pp", "pp2_gpipe_m4", "zbv_pp2_m4"]   # zbv: a rank hands itself a payload (no channel)
TORCH_PLANE = shared_job(2, "engine_exact", "--backend=gloo", *TORCH_PLANE_CASES, plane="gloo")


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_serial(shared_launch, case):
    """Losses and the whole state (rank 0), and every rank's own copies of its stages."""
    shared_launch(JOBS[config_of(case).world_size]).require([case, copies_name(case)])


@pytest.mark.parametrize("case", [(size, name) for size, names in RANDOM.items() for name in names],
                         ids=lambda case: case[1].replace(" ", "_"))
def test_random_configuration_matches_serial(shared_launch, case):
    size, name = case
    shared_launch(JOBS[size]).require([name, copies_name(name)])


@pytest.mark.parametrize("nprocs", sorted(GROUPS))
def test_full_state_dict_round_trip(shared_launch, nprocs):
    shared_launch(JOBS[nprocs]).require([round_trip_name(GROUPS[nprocs][0])])


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
    # issue 10: sync_batchnorm equals one full-batch serial run for data_parallel=2 (LP) and
    # local_dp=2 (SP+LP); with GEMS it keeps the directions' chunks apart (stated semantics)
    assert has(lambda c: c.sync_batchnorm and c.data_parallel == 2 and c.spatial_size == 0
               and c.parts == 1 and not c.gems)
    assert has(lambda c: c.sync_batchnorm and c.local_dp == 2 and c.spatial_size > 0
               and c.parts == 1 and not c.gems)
    assert has(lambda c: c.sync_batchnorm and c.gems)
    for model in ("se_resnet", "unet", "norms"):   # SE gates, U-Net, GroupNorm in SP+LP and SP+PP
        assert any(CASES[n][1] == model and config_of(n).spatial_size > 0 and config_of(n).parts == 1
                   for n in CASES)
        assert any(CASES[n][1] == model and config_of(n).spatial_size > 0 and config_of(n).parts > 1
                   for n in CASES)


def test_zbv_acceptance_cases_are_covered():
    """Issue 44: zbv on 2 ranks (4 stages), with a spatial first stage (2 tiles), data_parallel=2, recomputation."""

    def zbv(c) -> bool:
        return c.schedule == "zbv" and c.split_size == 2 * c.pipeline_positions

    def has(pred) -> bool:
        return any(pred(config_of(n)) for n in CASES)

    assert has(lambda c: zbv(c) and c.world_size == 2 and c.split_size == 4)
    assert has(lambda c: zbv(c) and c.spatial_size == 1 and c.num_spatial_parts == 2)
    assert has(lambda c: zbv(c) and c.data_parallel == 2)
    assert has(lambda c: zbv(c) and c.checkpoint_activations is not None)


def test_engine_on_torch_distributed_plane(shared_launch):
    """Same exactness with tensors on torch.distributed (gloo) instead of mpi4py."""
    shared_launch(TORCH_PLANE).require_clean(TORCH_PLANE_CASES)


def test_interleaved_acceptance_cases_are_covered():
    """Issue 44: interleaved V=2 on 2 and 4 ranks with m = 4 and 8, with a spatial first stage, with replicas."""
    def has(pred) -> bool:
        return any(pred(config_of(n)) for n in CASES)

    def interleaved(c) -> bool:
        return c.schedule == "interleaved" and c.virtual_stages == 2

    for ranks in (2, 4):
        for m in (4, 8):
            assert has(lambda c, ranks=ranks, m=m: interleaved(c) and c.world_size == ranks and c.parts == m
                       and c.spatial_size == 0 and c.data_parallel == 1)
    for ranks in (3, 4):
        assert has(lambda c, ranks=ranks: interleaved(c) and c.world_size == ranks and c.spatial_size == 1
                   and c.num_spatial_parts == 2)
    assert has(lambda c: interleaved(c) and c.spatial_size == 1 and c.checkpoint_activations is not None)
    assert has(lambda c: interleaved(c) and c.data_parallel == 2)


def test_zero_bubble_acceptance_cases_are_covered():
    """Issue 44: zb1 on 2 and 3 ranks, with a spatial first stage (2 tiles), data_parallel=2, recomputation."""
    def has(pred) -> bool:
        return any(pred(config_of(n)) for n in CASES)

    def zb1(c) -> bool:
        return c.schedule == "zb1"

    for ranks in (2, 3):
        assert has(lambda c, ranks=ranks: zb1(c) and c.world_size == ranks and c.spatial_size == 0
                   and c.data_parallel == 1)
    assert has(lambda c: zb1(c) and c.spatial_size == 1 and c.num_spatial_parts == 2)
    assert has(lambda c: zb1(c) and c.data_parallel == 2)
    assert has(lambda c: zb1(c) and c.checkpoint_activations is not None)
