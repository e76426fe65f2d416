"""``--slice-method DxRxC``: a volume's tile grid from the command line and the config (one process)."""

from __future__ import annotations

import pytest

from mpi4dl_nb.cli.args import config_from_args, parallel_flags
from mpi4dl_nb.cli.job_flags import add_job_flags
from mpi4dl_nb.cli.parser import CommandParser
from mpi4dl_nb.config import ConfigError, ParallelConfig, parse_slice_method
from mpi4dl_nb.layout import layout, layout_table
from mpi4dl_nb.spatial.geometry import TileGrid


def parsed(*argv: str) -> ParallelConfig:
    return config_from_args(add_job_flags(CommandParser(), ParallelConfig).parse_args(list(argv)))


@pytest.mark.parametrize("text,shape", [("2x2x2", (2, 2, 2)), ("1x1x4", (1, 1, 4)), ("4x1x1", (4, 1, 1)),
                                        (" 3X2x1 ", (3, 2, 1))])
def test_dxrxc_becomes_the_volume_grid_of_config_and_tile_grid(text, shape):
    parts = shape[0] * shape[1] * shape[2]
    cfg = parsed("--spatial-size", "1", "--num-spatial-parts", str(parts), "--slice-method", text)
    assert cfg.volume_grid == shape and cfg.tile_grid_shape == shape
    grid = TileGrid.from_slice_method(text.strip().lower(), parts)
    assert grid == TileGrid(depth=shape[0], rows=shape[1], cols=shape[2]) and grid.volumetric


def test_image_slice_methods_are_unchanged():
    cfg = parsed("--num-spatial-parts", "4", "--slice-method", "vertical")
    assert cfg.volume_grid is None and cfg.tile_grid_shape == cfg.grid_shape == (1, 4)


def test_dxrxc_whose_product_is_not_the_tile_count_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"slice_method: 2x2x2 has 8 tiles but num_spatial_parts=4.*=8"):
        parsed("--num-spatial-parts", "4", "--slice-method", "2x2x2")
    with pytest.raises(ConfigError, match="num_spatial_parts=6"):
        TileGrid.from_slice_method("3x2x2", 6)


@pytest.mark.parametrize("text", ["2x2", "2x0x2", "axbxc", "2x2x2x2"])
def test_malformed_slice_methods_are_refused_by_the_parser(text):
    with pytest.raises(ConfigError, match="2x2x2"):
        parse_slice_method(text)


def test_layout_shows_the_volume_grid_position_of_every_tile():
    cfg = parsed("--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "6", "--slice-method", "3x2x1")
    roles = layout(cfg)
    assert [(r.primary.tile_depth, r.primary.tile_row, r.primary.tile_col) for r in roles[:6]] == [
        (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (2, 0, 0), (2, 1, 0)]
    assert roles[5].describe() == "stage 0 tile 5 (d2,r1,c0)"
    table = layout_table(cfg).splitlines()
    assert table[2 + 5].split()[5] == "(2,1,0)" and table[2 + 6].split()[5] == "-"
    image = layout_table(parsed("--num-spatial-parts", "4")).splitlines()
    assert image[2 + 3].split()[5] == "(1,1)"   # image grids keep (row,col)


def test_volume_grid_round_trips_through_the_flags_and_is_kept_from_image_stages():
    cfg = parsed("--spatial-size", "1", "--num-spatial-parts", "8", "--slice-method", "2x2x2")
    flags = parallel_flags(cfg)
    assert flags[flags.index("--slice-method") + 1] == "2x2x2"
    assert parsed(*flags) == cfg and cfg.with_(parts=2).volume_grid == (2, 2, 2)
    with pytest.raises(ConfigError, match="slice_method: 2x2x2 tiles volumes"):
        _ = cfg.grid_shape   # the engine's image stages do not take a volume's grid
    assert cfg.validate(world_size=cfg.world_size, batch_size=2, image_size=(4, 32, 32)) is cfg   # 2x16x16 tiles
    with pytest.raises(ConfigError, match="2 tiles along depth of a 1x32x32 volume are 0 voxels"):
        cfg.validate(world_size=cfg.world_size, batch_size=2, image_size=(1, 32, 32))   # refused before any work
    with pytest.raises(ConfigError, match="image_size: slice_method 2x2x2 tiles volumes"):
        cfg.validate(image_size=(32, 32))
