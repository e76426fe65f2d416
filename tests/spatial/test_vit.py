"""timm vision transformers on tiles (issue 52): token-tile geometry, patch-cut refusals, TF-"same" windows
(pure), and, under mpiexec, five timm ViTs and a MAP head on 2x2 and 1x4 tiles equal to one process in float64,
outputs equal on every rank, what stays refused named (tests/mpi/vit_exact.py, one 4-rank launch shared with
other programs); a ViT's spatial stage with layer stages under data parallelism, GEMS, zb1, zbv, interleaved and bf16
(``vit_exact mixed``: jobs of the 4-, 5- and 6-rank launches).
"""

from __future__ import annotations

import math

import pytest

from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.spatial.geometry import KernelAxis, TileGrid
from mpi4dl_nb.spatial.same_padding import same_window
from mpi4dl_nb.spatial.tokens.tiles import TokenTiles, check_patch_grid, int_pair
from tests.support.battery import shared_job
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

MISSING = missing_modules("timm")
VIT_JOB = None if MISSING else shared_job(4, "vit_exact", timeout=600)
MIXED_SIZES = (4, 5, 6)   # the world sizes of vit_exact's mixed checks: jobs of the 4-, 5- and 6-rank launches
MIXED_JOBS = {} if MISSING else {size: shared_job(size, "vit_exact", "mixed", timeout=300) for size in MIXED_SIZES}


def test_every_token_lives_on_exactly_one_tile_prefix_on_tile_0():
    grid = TileGrid(2, 2)
    tiles = [TokenTiles(grid, (15, 14), t, num_prefix=5) for t in range(4)]
    indices = [i for tile in tiles for i in tile.token_indices()]
    assert sorted(indices) == list(range(15 * 14))
    assert [t.prefix_here for t in tiles] == [5, 0, 0, 0]
    assert tiles[0].key_counts == (8 * 7 + 5, 8 * 7, 7 * 7, 7 * 7)
    assert tiles[3].shape == (7, 7) and tiles[3].token_indices()[:2] == [8 * 14 + 7, 8 * 14 + 8]


def test_token_boxes_are_the_balanced_split_of_the_token_grid():
    grid = TileGrid(1, 4)
    tiles = TokenTiles(grid, (16, 16), 2, num_prefix=1)
    assert tiles.box == (0, 16, 8, 12) and tiles.image_tokens == 256 and tiles.prefix_here == 0


@pytest.mark.parametrize("rows,cols,size,patch,tokens", [(2, 2, 224, 16, (14, 14)), (1, 4, 256, 16, (16, 16)),
                                                         (2, 2, 448, 14, (32, 32)), (1, 4, 224, 14, (16, 16))])
def test_sizes_whose_tiles_hold_whole_patches(rows, cols, size, patch, tokens):
    assert check_patch_grid(TileGrid(rows, cols), (size, size), (patch, patch)) == tokens


@pytest.mark.parametrize("rows,cols,size,named", [(1, 4, 224, "e.g. 192 or 256"), (2, 2, 240, "e.g. 224 or 256"),
                                                  (2, 1, 232, "multiples of 32")])
def test_a_grid_that_cuts_a_patch_is_refused_naming_sizes_that_work(rows, cols, size, named):
    with pytest.raises(ConfigError, match="would cut a patch") as caught:
        check_patch_grid(TileGrid(rows, cols), (size, size), (16, 16))
    assert named in str(caught.value)


def test_int_pair():
    assert int_pair(16) == (16, 16) and int_pair([14, 16]) == (14, 16)
    with pytest.raises(TypeError):
        int_pair("16")


@pytest.mark.parametrize("size", [7, 8, 224, 225, 111])
@pytest.mark.parametrize("kernel,stride,dilation", [(7, 2, 1), (3, 2, 1), (3, 1, 2), (1, 1, 1), (4, 3, 1)])
def test_same_window_pads_as_timm_pad_same(size, kernel, stride, dilation):
    window = same_window(KernelAxis(kernel, stride, dilation), size)
    total = max((math.ceil(size / stride) - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)   # timm's formula
    assert (window.pad_before, window.pad_after) == (total // 2, total - total // 2)
    assert window.out_size(size) == math.ceil(size / stride)


def test_timm_vits_on_tiles_equal_one_process(shared_launch):
    from tests.mpi.vit_exact import check_names

    require_or_skip(MISSING, "timm's vision transformers", MODELS_EXTRA)
    assert VIT_JOB is not None
    shared_launch(VIT_JOB).require(check_names())


@pytest.mark.parametrize("size", MIXED_SIZES)
def test_a_vit_spatial_stage_mixed_with_data_parallel_gems_zero_bubble_interleaved_and_bf16(shared_launch, size):
    """A tiny ViT's embedding and first block on token tiles, the rest on layer stages, under data parallelism
    (local_dp copies, 2 replicas), GEMS, zb1, zbv, interleaved (float64, every rank's copies equal one process) and
    bf16 (the CNN path's bf16 rule); every mixed check runs in one of the registered launches."""
    from tests.mpi.vit_exact import MIXED, bf16_name, mixed_name, mixed_names

    require_or_skip(MISSING, "timm's vision transformers", MODELS_EXTRA)
    every = {mixed_name(label) for label in MIXED} | {bf16_name()}
    assert every == {name for n in MIXED_SIZES for name in mixed_names(n)}, "a mixed check runs in no launch"
    shared_launch(MIXED_JOBS[size]).require(mixed_names(size))
