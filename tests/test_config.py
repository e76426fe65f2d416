"""ParallelConfig: world sizes and every ConfigError with its message."""

import pytest

from mpi4dl_nb import ConfigError, ParallelConfig
from mpi4dl_nb.config import parse_balance


@pytest.mark.parametrize("kwargs, world", [
    (dict(split_size=2, spatial_size=1, num_spatial_parts=4), 5),
    (dict(split_size=3, spatial_size=2, num_spatial_parts=4), 9),
    (dict(split_size=4, spatial_size=0), 4),
    (dict(split_size=2, spatial_size=1, num_spatial_parts=4, local_dp=2), 6),
    (dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical",
          data_parallel=2), 6),
    (dict(split_size=2, spatial_size=0, times=2), 2),
    (dict(split_size=3, spatial_size=1, num_spatial_parts=3, slice_method="horizontal",
          local_dp=2, data_parallel=2), 14),
    (dict(split_size=1, spatial_size=1, num_spatial_parts=4), 4),       # every stage spatial (dense models)
    (dict(split_size=2, spatial_size=2, num_spatial_parts=2, slice_method="vertical", times=1), 4),
])
def test_world_size(kwargs, world):
    assert ParallelConfig(**kwargs).world_size == world


@pytest.mark.parametrize("kwargs, knob, fragment", [
    (dict(num_spatial_parts=6, slice_method="square"), "num_spatial_parts",
     "perfect square number of parts, got 6; use num_spatial_parts=4"),
    (dict(split_size=2, spatial_size=3), "spatial_size", "use spatial_size <= 2 (equal: every stage spatial"),
    (dict(split_size=2, spatial_size=2, local_dp=2), "local_dp", "every stage is spatial; use local_dp=1"),
    (dict(slice_method="diagonal"), "slice_method", "square, vertical, horizontal"),
    (dict(split_size=0), "split_size", "integer >= 1"),
    (dict(parts=0), "parts", "integer >= 1"),
    (dict(times=-1), "times", "integer >= 0"),
    (dict(local_dp=0), "local_dp", "integer >= 1"),
    (dict(data_parallel=0), "data_parallel", "integer >= 1"),
    (dict(fused_layers=2), "fused_layers", "set halo_d2=True"),
    (dict(split_size=1, spatial_size=0, times=1), "times", "split_size >= 2"),
    (dict(split_size=2, balance=(3,)), "balance", "1 entries but split_size=2"),
    (dict(split_size=2, balance=(3, 0)), "balance", "at least one layer"),
    (dict(spatial_size=1, num_spatial_parts=1), "num_spatial_parts", "at least 2 tiles"),
    (dict(num_spatial_parts=6, grid=(2, 2)), "grid", "product is num_spatial_parts"),
    (dict(schedule="zigzag"), "schedule", "'gpipe' or '1f1b'"),
])
def test_construction_errors(kwargs, knob, fragment):
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**kwargs)
    assert info.value.knob == knob
    assert fragment in str(info.value)


def test_world_size_mismatch_names_the_rank_count():
    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4)
    with pytest.raises(ConfigError) as info:
        cfg.validate(world_size=4)
    assert info.value.knob == "world_size"
    assert "needs 5 ranks" in str(info.value) and "mpiexec -n 5" in str(info.value)
    assert cfg.validate(world_size=5) is cfg


def test_balance_sum_and_too_few_layers():
    cfg = ParallelConfig(split_size=2, balance=(3, 4))
    with pytest.raises(ConfigError, match="sums to 7 but the model has 8 layers"):
        cfg.validate(num_layers=8)
    cfg.validate(num_layers=7)
    with pytest.raises(ConfigError, match="use split_size <= 2"):
        ParallelConfig(split_size=3, spatial_size=0).validate(num_layers=2)


@pytest.mark.parametrize("text, counts", [
    ("3,4,5", (3, 4, 5)), ("3, 4,5", (3, 4, 5)), ("[2,2]", (2, 2)), ("(3,4,5)", (3, 4, 5)), ("[3, 4,]", (3, 4)),
    ("3", (3,)), ("4 1", (4, 1)), (" 4 , 1 ", (4, 1)), ("", None), ("None", None), ("none", None), (None, None),
])
def test_one_balance_parser_reads_the_flags_and_the_widgets_syntax(text, counts):
    """``--balance`` took Python lists (3,4,5 / [3,4,5] / (3,4,5) / 3 / None), the widget's field 4, 1 or
    nothing; config.parse_balance reads both (and blanks between counts: 4 1, which the widget read as 41)."""
    assert parse_balance(text) == counts


@pytest.mark.parametrize("text", ["a,b", "4;1", "3,,4", "1.5", "[[1]]", "[3", "True", ",3"])
def test_a_balance_that_is_no_list_of_counts_names_the_knob_it_came_from(text):
    with pytest.raises(ConfigError, match=r"^balance: .* is not a list of layer counts per stage, e.g. 3,4,5"):
        parse_balance(text)
    with pytest.raises(ConfigError, match=r"^--balance: ") as caught:
        parse_balance(text, "--balance")
    assert caught.value.knob == "--balance"


def test_batch_must_divide():
    cfg = ParallelConfig(split_size=2, spatial_size=0, parts=4)
    with pytest.raises(ConfigError) as info:
        cfg.validate(batch_size=6)
    assert info.value.knob == "parts"
    assert "use batch_size 4 or 8" in str(info.value)
    assert "parts in [1, 2, 3, 6]" in str(info.value)
    cfg.validate(batch_size=8)
    gems = ParallelConfig(split_size=2, spatial_size=0, times=2, parts=1)
    assert gems.batch_divisor == 4
    with pytest.raises(ConfigError, match="2 x times 2 GEMS chunks"):
        gems.validate(batch_size=6)
    dp = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, local_dp=2,
                        data_parallel=2)
    with pytest.raises(ConfigError, match="data_parallel 2 x local_dp 2 x parts 1 = 4"):
        dp.validate(batch_size=2)


def test_tiles_smaller_than_receptive_field():
    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=16, slice_method="vertical")
    with pytest.raises(ConfigError) as info:
        cfg.validate(image_size=32, min_tile=7)
    assert info.value.knob == "num_spatial_parts"
    assert "16 tile columns of a 32x32 image are 2 px" in str(info.value)
    assert "at most 4 tile columns" in str(info.value)
    cfg.validate(image_size=256, min_tile=7)


def test_grid_shapes():
    assert ParallelConfig(num_spatial_parts=9).grid_shape == (3, 3)
    assert ParallelConfig(num_spatial_parts=4, slice_method="vertical").grid_shape == (1, 4)
    assert ParallelConfig(num_spatial_parts=4, slice_method="horizontal").grid_shape == (4, 1)
    assert ParallelConfig(num_spatial_parts=6, slice_method="vertical", grid=(2, 3)).grid_shape == (2, 3)
