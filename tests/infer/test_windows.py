"""Pure window geometry: margins, alignment, cores that tile the output, per-rank boxes, refusals."""

from __future__ import annotations

import pytest

from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.infer.windows import AxisField, WindowPlan, batches, intersect, padded_extent
from mpi4dl_nb.spatial.geometry import TileGrid

RESNET = AxisField(stride=4, before=12, after=41, align=4)     # measured for resnet v1 depth 8 at 32 px
DENSE = AxisField(stride=1, before=7, after=8, align=16)       # a U-Net-like net: per-pixel, 16-aligned


def test_margins_follow_the_field():
    assert (RESNET.lead_cells, RESNET.trail_cells, RESNET.unit) == (3, 10, 4)
    assert (DENSE.lead_cells, DENSE.trail_cells, DENSE.unit) == (7, 7, 16)
    # a window starting at pixel 40: its first exact cell is the first whose field starts at or after 40
    start, _ = RESNET.input_range((13, 20), 1000)
    assert start == 40 and 13 * 4 - RESNET.before >= start and 12 * 4 - RESNET.before < start + 4


@pytest.mark.parametrize("field", [RESNET, DENSE])
def test_inputs_are_aligned_and_hold_every_core_field(field):
    extent = 1000
    cells = (extent - 40) // field.stride
    for core in [(0, 5), (7, 30), (cells - 9, cells), (31, 32)]:
        start, stop = field.input_range(core, extent)
        assert start % field.unit == 0 and (stop % field.unit == 0 or stop == extent)
        j0, j1 = core
        assert start == 0 or j0 * field.stride - field.before >= start        # first cell's field inside
        assert stop == extent or (j1 - 1) * field.stride + field.after <= stop  # last cell's field inside


@pytest.mark.parametrize("grid", [TileGrid(2, 2), TileGrid(1, 4), TileGrid(3, 1)])
def test_cores_tile_the_output_and_rank_boxes_tile_each_input(grid):
    plan = WindowPlan(300, 700, 68, 168, RESNET, RESNET, grid, window=64)
    windows = plan.windows()
    covered = [[0] * 168 for _ in range(68)]
    for w in windows:
        r0, r1, c0, c1 = w.core
        for r in range(r0, r1):
            for c in range(c0, c1):
                covered[r][c] += 1
        boxes = [w.rank_box(grid, t) for t in range(grid.num_tiles)]
        assert sum((b[1] - b[0]) * (b[3] - b[2]) for b in boxes) == w.input_size[0] * w.input_size[1]
        y0, y1, x0, x1 = w.input
        assert (y1 - y0) <= grid.rows * 64 and (x1 - x0) <= grid.cols * 64
        cr0, _, cc0, _ = w.core_in_output
        assert cr0 == r0 - y0 // 4 and cc0 == c0 - x0 // 4
        assert y0 == 0 or r0 * 4 - RESNET.before >= y0, "first core row's field inside the input"
        assert x1 == 700 or (c1 - 1) * 4 + RESNET.after <= x1, "last core column's field inside the input"
    assert all(v == 1 for row in covered for v in row), "every output cell in exactly one core"
    sizes = {w.core[1] - w.core[0] for w in windows}
    assert max(sizes) - min(sizes) <= 1, "balanced cores"
    assert plan.shape[0] * plan.shape[1] == len(windows)
    assert len(plan.input_sizes()) == 1, "edge windows widened inwards to the interior windows' size"


def test_resume_plans_only_the_remaining_rows():
    plan = WindowPlan(300, 700, 68, 168, RESNET, RESNET, TileGrid(2, 2), window=48, first_row=30)
    assert min(w.core[0] for w in plan.windows()) == 30
    assert max(w.core[1] for w in plan.windows()) == 68


def test_too_small_a_window_is_refused_with_the_size_that_works():
    with pytest.raises(ConfigError, match=r"--window: 8 px per rank is too small.*use --window >= 28"):
        WindowPlan(300, 700, 68, 168, RESNET, RESNET, TileGrid(2, 2), window=8)
    WindowPlan(300, 700, 68, 168, RESNET, RESNET, TileGrid(2, 2), window=28)


def test_batches_group_equal_sizes_in_order():
    plan = WindowPlan(300, 700, 68, 168, RESNET, RESNET, TileGrid(1, 1), window=96)
    row = next(plan.window_rows())
    groups = batches(row, 3)
    assert [w for g in groups for w in g] == row
    assert [len(g) for g in groups] == [3] * (len(row) // 3) + ([len(row) % 3] if len(row) % 3 else [])
    mixed = [row[0], *WindowPlan(300, 700, 68, 168, RESNET, RESNET, TileGrid(1, 1), window=128).windows()[:2]]
    assert [len(g) for g in batches(mixed, 3)] == [1, 2]


def test_helpers():
    assert padded_extent(301, 4) == 304 and padded_extent(300, 32) == 320
    assert intersect((0, 4, 0, 4), (2, 6, 3, 9)) == (2, 4, 3, 4)
    assert intersect((0, 4, 0, 4), (4, 6, 0, 9)) is None
