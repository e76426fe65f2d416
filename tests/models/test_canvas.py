"""Whole-slide canvas checks (issue 43): sides in whole trunk strides per tile, the tissue channel of tissue-mean;
refused before any work with the sizes and flags that work. (Every pool also runs on one process: issue 51,
tests/data/test_canvas.py.)"""

from __future__ import annotations

import pytest
from torch import nn

from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.models.canvas import canvas_multiples, check_canvas, check_tissue_input, single_canvas_note
from mpi4dl_nb.models.pools import PoolKind
from mpi4dl_nb.spatial.geometry import TileGrid


def test_canvas_sides_are_multiples_of_tiles_times_stride():
    assert canvas_multiples(TileGrid(2, 2), 4) == (8, 8)
    assert canvas_multiples(TileGrid(3, 1), 4) == (12, 4)
    check_canvas(256, TileGrid(2, 2), 4)
    check_canvas((36, 8), TileGrid(3, 1), 4)


@pytest.mark.parametrize("size,grid,shown", [(260, TileGrid(2, 2), "--image-size 256 or 264"),
                                             (250, TileGrid(1, 4), "--image-size 240 or 256"),
                                             (10, TileGrid(3, 1), "--image-size 12")])
def test_a_canvas_off_the_stride_grid_is_refused_with_sizes_that_work(size, grid, shown):
    with pytest.raises(ConfigError, match="--image-size") as error:
        check_canvas(size, grid, 4)
    assert shown in str(error.value) and "multiple of" in str(error.value)
    for fit in (int(n) for n in shown.split("--image-size ")[1].split(" or ")):
        check_canvas(fit, grid, 4)


def test_tissue_mean_needs_the_mask_as_the_last_channel():
    check_tissue_input(PoolKind.TISSUE_MEAN, 3, 4)
    check_tissue_input(PoolKind.ATTENTION, 3, 3)
    with pytest.raises(ConfigError, match="--pool tissue-mean .* the data has 3 channels"):
        check_tissue_input(PoolKind.TISSUE_MEAN, 3, 3)


def test_one_canvas_per_batch_under_an_averaging_pool_with_batchnorm_gets_a_note():
    trunk = [nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())]
    for pool in (PoolKind.AVG, PoolKind.ATTENTION, PoolKind.TISSUE_MEAN):
        note = single_canvas_note(pool, 1, trunk)
        assert note is not None and f"--pool {pool.value}" in note and "--batch-size 2" in note
    assert single_canvas_note(PoolKind.MAX, 1, trunk) is None                     # max pooling learns at batch 1
    assert single_canvas_note(PoolKind.ATTENTION, 2, trunk) is None
    assert single_canvas_note(PoolKind.ATTENTION, 1, [nn.Conv2d(3, 4, 3), nn.ReLU()]) is None   # no BatchNorm
