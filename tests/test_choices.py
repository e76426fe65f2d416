"""SliceMethod and ScheduleKind: one definition of the valid choices, text or member accepted."""

from __future__ import annotations

import json

import pytest

from mpi4dl_nb.config import (
    SCHEDULES,
    SLICE_METHODS,
    ConfigError,
    ParallelConfig,
    ScheduleKind,
    SliceMethod,
)
from mpi4dl_nb.spatial.geometry import TileGrid


def test_text_and_members_build_equal_configs():
    by_text = ParallelConfig(num_spatial_parts=2, slice_method="vertical", schedule="1f1b")
    by_member = ParallelConfig(num_spatial_parts=2, slice_method=SliceMethod.VERTICAL,
                               schedule=ScheduleKind.ONE_F_ONE_B)
    assert by_text == by_member and hash(by_text) == hash(by_member)
    assert by_text.slice_method is SliceMethod.VERTICAL and by_text.schedule is ScheduleKind.ONE_F_ONE_B
    assert by_text.with_(slice_method="horizontal").slice_method is SliceMethod.HORIZONTAL


def test_as_dict_is_plain_json_and_round_trips():
    cfg = ParallelConfig(num_spatial_parts=4, slice_method="square", schedule="gpipe")
    data = cfg.as_dict()
    assert type(data["slice_method"]) is str and type(data["schedule"]) is str
    assert json.loads(json.dumps(data))["slice_method"] == "square"
    assert ParallelConfig(**data) == cfg
    assert "slice_method='square'" in repr(cfg)     # a repr that is a valid constructor call


def test_one_list_of_choices():
    assert SLICE_METHODS == ("square", "vertical", "horizontal")
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved", "zb1", "zbv")
    with pytest.raises(ConfigError, match="'spiral' is not one of square, vertical, horizontal"):
        ParallelConfig(slice_method="spiral")
    with pytest.raises(ConfigError, match="'gpipe' or '1f1b'"):
        ParallelConfig(schedule=None)


@pytest.mark.parametrize("method", list(SliceMethod))
@pytest.mark.parametrize("parts", [4, 9])
def test_config_grid_and_tile_grid_agree(method, parts):
    cfg = ParallelConfig(num_spatial_parts=parts, slice_method=method)
    grid = TileGrid.from_slice_method(str(method), parts)
    assert cfg.grid_shape == (grid.rows, grid.cols) == method.grid_shape(parts)
