"""Segmentation on tiles == one process (float64): every stage spatial (the loss on the tiles) alone, with
pipelining (1F1B), GEMS with fused halos, data parallelism with sync_batchnorm, recomputation; and a
spatial stage before a layer-parallel one (the loss on the joined map). The shared 4-rank launches of the
mpi plane and, for two cases, the torch plane (tests/mpi/segmentation_exact.py)."""

from __future__ import annotations

import pytest

from tests.mpi.segmentation_exact import CASES
from tests.support.battery import shared_job

JOB = shared_job(4, "segmentation_exact", *CASES, timeout=400)
TORCH_PLANE_CASES = ("sp2_sp2_pp_1f1b", "sp2_sp2_gems_d2")
TORCH_PLANE = shared_job(4, "segmentation_exact", "--backend=gloo", *TORCH_PLANE_CASES, plane="gloo", timeout=300)


@pytest.mark.parametrize("case", list(CASES))
def test_segmentation_layout_matches_one_process(shared_launch, case):
    """Losses and the whole state on rank 0, every rank's copies, forward-only tiles in eval mode."""
    shared_launch(JOB).require([case, f"{case} copies", f"{case} eval tiles"])


@pytest.mark.parametrize("case", TORCH_PLANE_CASES)
def test_segmentation_on_the_torch_plane(shared_launch, case):
    """The NCCL code path (gloo on CPU): pipelined tiles and GEMS' two tile groups, the loss's sums on tiles."""
    shared_launch(TORCH_PLANE).require([case, f"{case} copies", f"{case} eval tiles"])


def test_a_classifier_loss_is_refused_when_every_stage_is_spatial(shared_launch):
    shared_launch(JOB).require(["classifier loss refused"])


def test_the_cases_cover_the_layouts():
    from mpi4dl_nb import ParallelConfig

    configs = [ParallelConfig(**knobs) for knobs, *_ in CASES.values()]
    assert any(c.all_spatial and c.split_size == 1 for c in configs)
    assert any(c.all_spatial and c.parts > 1 for c in configs)
    assert any(c.all_spatial and c.gems for c in configs)
    assert any(c.all_spatial and c.data_parallel > 1 for c in configs)
    assert any(c.all_spatial and c.checkpoint_activations is not None for c in configs)
    assert any(not c.all_spatial and c.spatial_size > 0 for c in configs)
    assert all(c.world_size == 4 for c in configs)
