"""HybridEngine on volumes == one process, in the shared 8- and 4-rank launches (tests/mpi/volume_exact.py).

float64: the 3-D U-Net on 2x2x2 tiles (8 ranks); 1x2x2 with recomputation, a 3x1x1 spatial encoder before a layer
stage with 1F1B micro-batches, two spatial stages of 2x1x1 tiles with GEMS, 1x1x2 tiles with data_parallel=2 (as
2x2x2 x 2 would need 16 ranks) (4 ranks). The 3-D ResNet trunk (2 stages of ResNet-10): its spatial part on 1x2x2
tiles before a layer stage with local_dp=4 (8 ranks) and on uneven 1x3x1 tiles before a layer stage (4 ranks).
bf16 (4 ranks): 1x2x2 all spatial with BatchNorm3d and trilinear up-sampling or ConvTranspose3d; a 3x1x1
GroupNorm encoder before a layer stage. swinunetr3d: its encoder on 3x1x1 tiles before a layer stage, 1F1B,
recomputation (4 ranks); ``train --task segmentation --model swinunetr3d`` on 2x2x2 tiles from the command line's
plan, 3 steps (8 ranks). One process: the volume tile cut of a step's input.
"""

from __future__ import annotations

import pytest
import torch

from mpi4dl_nb import ParallelConfig
from mpi4dl_nb.pipeline.step_input import ShardedMasks, StepInput
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.mpi.volume_exact import BF16_CASES, CASES, EIGHT_RANKS, FOUR_RANKS, SWIN_CASES, SWIN_CLI, WIDE_CASES
from tests.support.battery import shared_job

EIGHT = shared_job(8, "volume_exact", *EIGHT_RANKS, SWIN_CLI, timeout=300)
FOUR = shared_job(4, "volume_exact", *FOUR_RANKS, *BF16_CASES, *SWIN_CASES, timeout=300)


@pytest.mark.parametrize("case", list(CASES))
def test_volume_models_on_volume_tiles_match_one_process(shared_launch, case):
    """Losses and the whole state on rank 0 (1e-9), every rank's copies, forward-only 3-D tiles in eval mode."""
    shared_launch(EIGHT if case in EIGHT_RANKS else FOUR).require([case, f"{case} copies", f"{case} eval tiles"])


@pytest.mark.parametrize("case", list(SWIN_CASES))
def test_swinunetr3d_through_the_engine_matches_one_process(shared_launch, case):
    """Uneven 3x1x1 tiles of the Swin encoder before a layer stage, 1F1B, recomputation: losses, state, copies, eval."""
    assert all(ParallelConfig(**knobs).world_size == 4 for knobs, *_ in SWIN_CASES.values())
    shared_launch(FOUR).require([case, f"{case} copies", f"{case} eval tiles"])


def test_swinunetr3d_from_the_command_line_on_8_tiles_matches_one_process(shared_launch):
    """3 steps of train --model swinunetr3d on 2x2x2 tiles: losses and final weights within 1e-9 of one process."""
    shared_launch(EIGHT).require([SWIN_CLI])


@pytest.mark.parametrize("case", list(BF16_CASES))
def test_bf16_on_volume_tiles_trains_like_one_process_under_the_same_autocast(shared_launch, case):
    """Float32 unet3d under precision='bf16' against serial bf16 by the 2-D rule (tests/support/bf16_rule.py)."""
    shared_launch(FOUR).require([f"{case} bf16 vs serial"])


def test_the_cases_cover_the_layouts():
    configs = {name: ParallelConfig(**knobs) for name, (knobs, *_) in CASES.items()}
    unets = {name for name in CASES if CASES[name][2].get("model") != "resnet3d"}
    assert all(c.volume_grid is not None for c in configs.values())
    assert any(c.volume_grid == (2, 2, 2) and c.all_spatial and c.checkpoint_activations is None
               and CASES[name][2]["norm"] == "batch" for name, c in configs.items() if name in unets)
    resnets = [configs[name] for name in CASES if name not in unets]
    assert any(c.volume_grid == (1, 2, 2) for c in resnets) and all(c.spatial_size == 1 < c.split_size for c in resnets)
    assert any(c.checkpoint_activations is not None for c in configs.values())
    assert any(not c.all_spatial and c.spatial_size == 1 and c.parts > 1 for c in configs.values())
    assert any(c.data_parallel == 2 for c in configs.values())
    assert {CASES[name][2]["upsampling"] for name in unets} == {"trilinear", "transposed"}
    assert any(c.all_spatial and c.gems for c in configs.values())
    assert sorted(c.world_size for c in configs.values()) == [4, 4, 4, 4, 4, 8, 8]


def test_a_step_cuts_volumes_and_label_volumes_into_each_rank_s_3d_tile():
    grid = TileGrid(depth=2, rows=2, cols=1)
    x, y = torch.randn(3, 1, 6, 4, 5), torch.randint(0, 2, (3, 6, 4, 5))
    data = StepInput(x, y, 3)
    cpu = torch.device("cpu")
    for tile in range(grid.num_tiles):
        (d0, d1), (r0, r1), (c0, c1) = grid.extent(tile, (6, 4, 5))
        assert torch.equal(data.images_for(slice(1, 3), tile, grid, cpu), x[1:3, :, d0:d1, r0:r1, c0:c1])
        assert torch.equal(data.labels_for(slice(1, 3), cpu, tile, grid), y[1:3, d0:d1, r0:r1, c0:c1])


def test_readers_on_a_volume_grid_get_the_tiles_extent_and_need_three_sides():
    grid = TileGrid(depth=2, rows=1, cols=1)
    cpu = torch.device("cpu")
    asked = []
    reader = StepInput(lambda rows, box: asked.append(box) or torch.zeros(1), None, 2, (6, 4, 4))
    reader.images_for(slice(0, 1), 1, grid, cpu)
    masks = StepInput(None, ShardedMasks(lambda rows, box: asked.append(box) or torch.zeros(1), 2, (6, 4, 4)), 2)
    masks.labels_for(slice(0, 1), cpu, 0, grid)
    assert asked == [((3, 6), (0, 4), (0, 4)), ((0, 3), (0, 4), (0, 4))]
    flat = StepInput(lambda rows, box: torch.zeros(1), None, 2, (4, 4))
    with pytest.raises(ValueError, match=r"need a size of 3 axes \(\(D, H, W\)\), got \(4, 4\)"):
        flat.images_for(slice(0, 1), 0, grid, cpu)


def test_the_hand_run_cases_are_the_literal_reading():
    """2x2x2 BatchNorm U-Net with a layer stage after the spatial encoder (9 ranks) and with data_parallel=2 (16):
    run by hand (tests/mpi/volume_exact.py says how), never by the suite's launches."""
    wide = {name: ParallelConfig(**knobs) for name, (knobs, *_) in WIDE_CASES.items()}
    assert all(c.volume_grid == (2, 2, 2) and WIDE_CASES[n][2]["norm"] == "batch" for n, c in wide.items())
    assert sorted(c.world_size for c in wide.values()) == [9, 16]
    assert any(not c.all_spatial for c in wide.values()) and any(c.data_parallel == 2 for c in wide.values())
    assert not set(wide) & {*EIGHT_RANKS, *FOUR_RANKS}
