"""layout(): the role of every rank for several configurations, GEMS and local DP included."""

from mpi4dl_nb import ParallelConfig, layout
from mpi4dl_nb.layout import layout_table, stage_holders


def roles(cfg):
    return [(r.stage, r.tile, r.local_dp_index, r.replica) for r in layout(cfg)]


def test_sp_lp_square_five_ranks():
    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4)
    rs = layout(cfg)
    assert len(rs) == 5
    assert roles(cfg) == [(0, 0, 0, 0), (0, 1, 0, 0), (0, 2, 0, 0), (0, 3, 0, 0), (1, None, 0, 0)]
    assert [(r.primary.tile_row, r.primary.tile_col) for r in rs[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert rs[0].primary.stage_ranks == (0, 1, 2, 3) and rs[4].primary.stage_ranks == (4,)
    assert all(r.mirror is None for r in rs)


def test_split3_spatial2_nine_ranks_vertical():
    cfg = ParallelConfig(split_size=3, spatial_size=2, num_spatial_parts=4, slice_method="vertical")
    rs = layout(cfg)
    assert [r.stage for r in rs] == [0] * 4 + [1] * 4 + [2]
    assert [r.tile for r in rs[4:8]] == [0, 1, 2, 3]
    assert [(r.primary.tile_row, r.primary.tile_col) for r in rs[4:8]] == [(0, c) for c in range(4)]
    assert rs[5].primary.stage_ranks == (4, 5, 6, 7)


def test_pure_layer_parallel():
    cfg = ParallelConfig(split_size=3, spatial_size=0)
    assert roles(cfg) == [(0, None, 0, 0), (1, None, 0, 0), (2, None, 0, 0)]
    assert not any(r.spatial for r in layout(cfg))


def test_gems_times2_mirror_is_reversed():
    cfg = ParallelConfig(split_size=3, spatial_size=0, times=2)
    rs = layout(cfg)
    assert [r.stage for r in rs] == [0, 1, 2]
    assert [r.mirror.stage for r in rs] == [2, 1, 0]
    assert stage_holders(cfg, 0) == [0, 2]
    assert stage_holders(cfg, 1) == [1]


def test_sp_gems_mirror_tiles_on_last_ranks():
    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, times=1)
    rs = layout(cfg)
    # mirror: in-replica index i plays the primary role of index 4 - i
    assert [r.mirror.stage for r in rs] == [1, 0, 0, 0, 0]
    assert [r.mirror.tile for r in rs] == [None, 3, 2, 1, 0]
    assert rs[4].mirror.stage_ranks == (4, 3, 2, 1)
    assert rs[0].mirror.stage_ranks == (0,)
    assert stage_holders(cfg, 0) == [0, 1, 2, 3, 4]
    assert stage_holders(cfg, 1) == [0, 4]


def test_local_dp_two_copies():
    cfg = ParallelConfig(split_size=3, spatial_size=1, num_spatial_parts=2, slice_method="vertical",
                         local_dp=2)
    assert roles(cfg) == [(0, 0, 0, 0), (0, 1, 0, 0), (1, None, 0, 0), (1, None, 1, 0),
                          (2, None, 0, 0), (2, None, 1, 0)]
    assert layout(cfg)[3].primary.stage_ranks == (2, 3)


def test_two_data_parallel_replicas():
    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, data_parallel=2)
    rs = layout(cfg)
    assert len(rs) == 10
    assert [r.replica for r in rs] == [0] * 5 + [1] * 5
    assert rs[7].tile == 2 and rs[7].primary.stage_ranks == (5, 6, 7, 8)
    assert stage_holders(cfg, 1) == [4, 9]


def test_table_lists_every_rank():
    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, times=1)
    text = layout_table(cfg)
    lines = text.splitlines()
    assert len(lines) == 2 + 5
    assert "mirror stage" in lines[0]
    assert lines[2].split()[:5] == ["0", "0", "0", "spatial", "0"]


def test_config_layout_method_matches_function():
    cfg = ParallelConfig(split_size=3, spatial_size=1, num_spatial_parts=4, local_dp=2)
    assert cfg.layout() == layout(cfg)
    assert len(cfg.layout()) == cfg.world_size == 8
