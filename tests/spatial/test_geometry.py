"""Pure tile geometry: split rule, grids, tile boxes, per-layer halo plans and their refusals."""

from __future__ import annotations

import itertools
import random

import pytest

from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.spatial.geometry import KernelAxis, LayerHalo, TileGrid, plan_window_axis, split_ranges


def test_split_rule_first_tiles_get_the_extra_row():
    assert split_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_ranges(64, 4) == [(0, 16), (16, 32), (32, 48), (48, 64)]
    for size, parts in itertools.product(range(1, 40), range(1, 8)):
        ranges = split_ranges(size, parts)
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        lengths = [e - s for s, e in ranges]
        assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)


def test_slice_methods():
    assert TileGrid.from_slice_method("square", 9) == TileGrid(3, 3)
    assert TileGrid.from_slice_method("vertical", 4) == TileGrid(1, 4)    # vertical cuts
    assert TileGrid.from_slice_method("horizontal", 4) == TileGrid(4, 1)  # horizontal cuts
    with pytest.raises(ConfigError) as err:
        TileGrid.from_slice_method("square", 6)
    assert err.value.knob == "num_spatial_parts" and "4 or 9" in str(err.value)
    with pytest.raises(ConfigError) as err:
        TileGrid.from_slice_method("diagonal", 4)
    assert err.value.knob == "slice_method" and "vertical" in str(err.value)


def test_positions_neighbours_and_boxes():
    grid = TileGrid(2, 3)
    assert grid.num_tiles == 6 and grid.position(4) == (1, 1)
    assert grid.neighbors(4) == {"top": 1, "left": 3, "right": 5, "top_left": 0, "top_right": 2}
    assert grid.neighbor(0, -1, 0) is None
    assert grid.tile_box(4, 100, 120) == (50, 100, 40, 80)
    for height, width in ((64, 64), (100, 120), (7, 11)):
        covered = [[0] * width for _ in range(height)]
        for r0, r1, c0, c1 in grid.tile_boxes(height, width):
            for r in range(r0, r1):
                for c in range(c0, c1):
                    covered[r][c] += 1
        assert all(v == 1 for row in covered for v in row)
    with pytest.raises(ConfigError) as err:
        TileGrid(3, 3).check_size(2, 10)
    assert err.value.knob == "image_size"


def _reads(window: KernelAxis, out: int) -> list[int]:
    """Input positions (image coordinates) output ``out`` reads — the serial definition."""
    return [out * window.stride - window.pad_before + j * window.dilation
            for j in range(window.kernel)]


def _check_axis(size: int, parts: int, window: KernelAxis) -> None:
    out_size = window.out_size(size)
    try:
        plans = plan_window_axis(size, parts, window)
    except ConfigError as error:
        # refused only when it must be: an empty tile, or data beyond the adjacent tile
        owned_in, owned_out = split_ranges(size, parts), split_ranges(out_size, parts) \
            if out_size >= parts else None
        if owned_out is None or size < parts:
            return
        for i, (o0, o1) in enumerate(owned_out):
            reads = [p for o in range(o0, o1) for p in _reads(window, o) if 0 <= p < size]
            lo = owned_in[i - 1][0] if i > 0 else 0
            hi = owned_in[i + 1][1] if i < parts - 1 else size
            if reads and (min(reads) < lo or max(reads) >= hi):
                return
        raise AssertionError(f"needless refusal {size} {parts} {window}: {error}") from None
    owned_out = split_ranges(out_size, parts)
    for i, plan in enumerate(plans):
        # the needed range is exactly what the owned outputs read
        reads = [p for o in range(*owned_out[i]) for p in _reads(window, o)]
        assert plan.needed == (min(reads), max(reads) + 1)
        # pieces tile the needed range in order: pad, from prev, own kept rows, from next, pad
        pieces = [(plan.needed[0], plan.needed[0] + plan.pad_before), plan.recv_prev, plan.keep,
                  plan.recv_next, (plan.needed[1] - plan.pad_after, plan.needed[1])]
        pieces = [p for p in pieces if p[1] > p[0]]
        assert pieces[0][0] == plan.needed[0] and pieces[-1][1] == plan.needed[1]
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), (pieces, plan)
        if plan.recv_prev[1] > plan.recv_prev[0]:
            assert plans[i - 1].owned[0] <= plan.recv_prev[0]
            assert plans[i - 1].send_next == plan.recv_prev
        if plan.recv_next[1] > plan.recv_next[0]:
            assert plan.recv_next[1] <= plans[i + 1].owned[1]
            assert plans[i + 1].send_prev == plan.recv_next


def test_axis_plans_match_the_serial_window_exhaustively():
    rng = random.Random(5)
    for _ in range(3000):
        kernel = rng.randint(1, 7)
        dilation = rng.randint(1, 2)
        span = dilation * (kernel - 1) + 1
        pad = rng.randint(0, span // 2)
        window = KernelAxis(kernel, rng.randint(1, 3), dilation, pad, rng.choice([pad, pad + 1]))
        size = rng.randint(span, 70)
        _check_axis(size, rng.randint(1, 5), window)


def test_stride_two_branches_own_the_same_outputs():
    grid = TileGrid(3, 3)
    main = grid.layer_halo(100, 120, 3, 2, 1)
    down = grid.layer_halo(100, 120, 1, 2, 0)
    assert (main.out_height, main.out_width) == (down.out_height, down.out_width) == (50, 60)
    assert [t.out_box for t in main] == [t.out_box for t in down] == grid.tile_boxes(50, 60)
    assert down.message_count == 0 and min(down.tile(4).halo.values()) == -1   # trims only


def test_layer_halo_is_inspectable():
    geometry = TileGrid(3, 3).layer_halo(64, 64, kernel=3, stride=1, padding=1)
    centre = geometry.tile(4)
    assert centre.halo == {"top": 1, "bottom": 1, "left": 1, "right": 1}
    assert centre.padding == {"top": 0, "bottom": 0, "left": 0, "right": 0}
    assert geometry.tile(0).padding == {"top": 1, "bottom": 0, "left": 1, "right": 0}
    # two-phase: 12 row messages and 12 column messages, no diagonal ones
    messages = geometry.messages()
    assert len([m for m in messages if m.phase == "rows"]) == 12
    assert len([m for m in messages if m.phase == "cols"]) == 12
    for m in messages:
        (r1, c1), (r2, c2) = geometry.grid.position(m.src), geometry.grid.position(m.dst)
        assert abs(r1 - r2) + abs(c1 - c2) == 1
    # the column message 4 -> 5 carries the rows 4 received from 1 and 7: the corners
    to_right = [m for m in geometry.messages(4) if m.src == 4 and m.dst == 5][0]
    r0, r1, c0, c1 = to_right.box
    assert (r0, r1) == (21, 44) and (c0, c1) == (42, 43)
    assert "tile 4" in geometry.describe()


def test_refusals_name_the_knob_and_an_alternative():
    grid = TileGrid(3, 3)
    with pytest.raises(ConfigError) as err:
        grid.layer_halo(4, 64, 3, 2, 1)          # 2 output rows for 3 tile rows
    assert err.value.knob == "num_spatial_parts" and "image_size" in str(err.value)
    with pytest.raises(ConfigError) as err:
        grid.layer_halo(9, 9, 9, 1, 4)           # 4-row halo from 3-row tiles
    assert "halo is wider than a tile" in str(err.value)
    geometry = LayerHalo.for_windows(TileGrid(1, 2), 10, 10, KernelAxis(), KernelAxis(3, 1, 1, 1, 1))
    assert geometry.message_count == 2


def test_fused_plan_chains_layer_ranges():
    from mpi4dl_nb.spatial.geometry import plan_fused_axis

    windows = [KernelAxis(3, 1, 1, 1, 1), KernelAxis(5, 2, 1, 2, 2), KernelAxis(3, 1, 2, 2, 2)]
    exchange, levels = plan_fused_axis(100, 3, windows)
    finals = [lv[-1].out for lv in levels]
    assert finals == split_ranges(windows[2].out_size(windows[1].out_size(100)), 3)
    for plan, lv in zip(exchange, levels):
        assert plan.needed == lv[0].needed
        for window, a, b in zip(windows, lv, lv[1:]):
            assert a.out == b.data                      # each layer computes what the next holds
            assert window.needed(a.out) == a.needed
            assert b.data == (max(b.needed[0], 0), min(b.needed[1], b.in_size))
    # wider than one neighbour: refused, naming fused_layers
    with pytest.raises(ConfigError) as err:
        plan_fused_axis(30, 3, [KernelAxis(5, 1, 1, 2, 2)] * 6)
    assert err.value.knob == "fused_layers"
