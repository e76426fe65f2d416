"""Per-rank memory and input: ranks keep only their stages' weights, and may pass only their part of the batch."""

from __future__ import annotations

import pytest
import torch

from mpi4dl_nb.pipeline.step_input import ShardedImages, StepInput, resolve_batch_size, resolve_image_size
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.mpi.engine_memory import check_names
from tests.support.battery import shared_job

LAUNCHES = {3: ("gems3_t1", "pp3_1f1b_m4"), 5: ("sp_gems_pp", "sp_lp_square")}
JOBS = {nprocs: shared_job(nprocs, "engine_memory", *cases) for nprocs, cases in LAUNCHES.items()}


@pytest.mark.parametrize("nprocs,case", [(n, case) for n, cases in LAUNCHES.items() for case in cases])
def test_ranks_hold_only_their_stages_and_take_their_input(shared_launch, nprocs, case):
    shared_launch(JOBS[nprocs]).require(check_names(case))


def test_batch_size_comes_from_argument_images_or_labels():
    x, y = torch.zeros(4, 3, 8, 8), torch.zeros(4, dtype=torch.long)
    assert resolve_batch_size(x, y, None) == 4
    assert resolve_batch_size(None, y, None) == 4
    assert resolve_batch_size(None, None, 4) == 4
    assert resolve_batch_size(ShardedImages(lambda r, b: x[r], 4, (8, 8)), None, None) == 4
    with pytest.raises(ValueError, match="batch_size=N"):
        resolve_batch_size(lambda r, b: x[r], None, None)
    with pytest.raises(ValueError, match="inconsistent"):
        resolve_batch_size(x, y[:3], None)
    with pytest.raises(ValueError, match="inconsistent"):
        resolve_batch_size(x, None, 8)
    assert resolve_image_size(None, 8) == (8, 8)
    assert resolve_image_size(ShardedImages(lambda r, b: x, 4, (8, 6)), None) == (8, 6)


def test_callable_input_equals_the_cut_of_the_global_batch():
    grid = TileGrid(2, 2)
    x = torch.randn(4, 3, 7, 9, dtype=torch.float64)
    y = torch.arange(4)
    seen = []

    def read(rows, box):
        seen.append((rows, box))
        r0, r1, c0, c1 = box if box is not None else (0, 7, 0, 9)
        return x[rows, :, r0:r1, c0:c1].clone()
    whole = StepInput(x, y, 4)
    parts = StepInput(read, lambda rows: y[rows], 4, (7, 9))
    cpu = torch.device("cpu")
    for tile in (None, 0, 1, 2, 3):
        rows = slice(2, 4)
        assert torch.equal(whole.images_for(rows, tile, grid, cpu),
                           parts.images_for(rows, tile, grid, cpu))
        assert torch.equal(whole.labels_for(rows, cpu), parts.labels_for(rows, cpu))
    assert seen[0] == (slice(2, 4), None) and seen[1] == (slice(2, 4), grid.tile_box(0, 7, 9))


def test_missing_input_names_the_argument():
    StepInput(None, None, 4).check(3, runs_first=False, runs_spatial_first=False, runs_last=False)
    with pytest.raises(ValueError, match="images is None"):
        StepInput(None, None, 4).check(0, runs_first=True, runs_spatial_first=False, runs_last=False)
    with pytest.raises(ValueError, match="labels is None"):
        StepInput(None, None, 4).check(2, runs_first=False, runs_spatial_first=False, runs_last=True)
    with pytest.raises(ValueError, match="image_size"):
        StepInput(lambda r, b: None, None, 4).check(0, runs_first=True, runs_spatial_first=True,
                                                    runs_last=False)
    with pytest.raises(TypeError, match="images must be"):
        StepInput("pics", None, 4).check(0, runs_first=True, runs_spatial_first=False,
                                         runs_last=False)
