"""Region plans (pure): the interior read from the owned tile is the extended tile's, bands cover the rest once."""

from __future__ import annotations

import itertools

from mpi4dl_nb.spatial.geometry import AxisExchange, KernelAxis, TileGrid, plan_window_axis, split_ranges
from mpi4dl_nb.spatial.kernel_layer import ceil_kernel
from mpi4dl_nb.spatial.region import Source, plan_region_axis, region_plan, segments

WINDOWS = [KernelAxis(3, 2, 1, 1, 1), KernelAxis(1, 2), KernelAxis(7, 2, 1, 3, 3), KernelAxis(3, 1, 2, 1, 1),
           KernelAxis(2, 2), KernelAxis(3, 2, 2, 2, 2), KernelAxis(3, 1, 1, 1, 1), KernelAxis(4, 3, 1, 1, 2)]


def extended(plan: AxisExchange) -> list[tuple[Source, int]]:
    """Each extended-tile position as (source, image position): what the op reads there."""
    return [(Source.PAD if not 0 <= p < plan.size else
             Source.OWN if plan.keep[0] <= p < plan.keep[1] else
             Source.PREV if p < plan.owned[0] else Source.NEXT, p)
            for p in range(*plan.needed)]


def axis_plans():
    for window, size, parts in itertools.product(WINDOWS, range(9, 41, 3), (1, 2, 3, 4)):
        for ceil in (False, True):
            w = ceil_kernel(window, size) if ceil else window
            try:
                plans = plan_window_axis(size, parts, w)
            except Exception:   # noqa: BLE001 - refused geometries (halo wider than a tile)
                continue
            for plan in plans:
                yield w, plan


def test_segments_describe_the_extended_tile():
    for _, plan in axis_plans():
        labels = extended(plan)
        found = [(a, b, src) for a, b, src in segments(plan)]
        assert found[0][0] == 0 and found[-1][1] == plan.needed_len
        assert all(x[1] == y[0] for x, y in zip(found, found[1:]))
        for a, b, src in found:
            assert {labels[i][0] for i in range(a, b)} == {src}


def test_interior_windows_read_the_same_tile_positions_without_padding():
    checked = 0
    for window, plan in axis_plans():
        for cap in (None, window.kernel // 2):
            region = plan_region_axis(plan, window.span, window.stride, cap)
            if region is None:
                continue
            checked += 1
            labels = extended(plan)
            height = plan.owned[1] - plan.owned[0]
            o0, o1 = split_ranges(window.out_size(plan.size), plan.parts)[plan.index]
            assert region.out == o1 - o0
            assert cap is None or region.pad <= cap
            assert 0 <= region.start < height and region.first >= 0
            lo, hi = region.interior
            assert region.first <= lo < hi <= min(region.first + region.native, region.out)
            for o in range(lo, hi):
                j = o - region.first
                for t in range(window.kernel):
                    e = o * window.stride + t * window.dilation
                    source, image = labels[e]
                    tile = region.start + j * window.stride - region.pad + t * window.dilation
                    if source is Source.OWN:
                        assert region.start <= tile < height and plan.owned[0] + tile == image
                    else:   # native padding, standing for the image's padding (never tile data)
                        assert source is Source.PAD
                        assert (region.start == 0 and -region.pad <= tile < 0) or \
                            height <= tile < height + region.pad
    assert checked > 500


def test_bands_and_interior_cover_every_output_once_and_boxes_are_their_windows():
    grid = TileGrid(3, 2)
    for rows_w, cols_w in [(WINDOWS[0], WINDOWS[0]), (WINDOWS[2], WINDOWS[4]), (WINDOWS[7], WINDOWS[5])]:
        for height, width in [(37, 41), (50, 33)]:
            r_plans = plan_window_axis(height, grid.rows, rows_w)
            c_plans = plan_window_axis(width, grid.cols, cols_w)
            for rp, cp in itertools.product(r_plans, c_plans):
                plan = region_plan((rp, cp), (rows_w.span, cols_w.span), (rows_w.stride, cols_w.stride))
                assert plan is not None
                out_h, out_w = plan.axes[0].out, plan.axes[1].out
                cover = [[0] * out_w for _ in range(out_h)]
                boxes = [(plan.interior, None)] + list(plan.bands)
                for ((r0, r1), (c0, c1)), box in boxes:
                    for r, c in itertools.product(range(r0, r1), range(c0, c1)):
                        cover[r][c] += 1
                    if box is not None:
                        assert box == ((r0 * rows_w.stride, (r1 - 1) * rows_w.stride + rows_w.span),
                                       (c0 * cols_w.stride, (c1 - 1) * cols_w.stride + cols_w.span))
                        assert box[0][1] <= rp.needed_len and box[1][1] <= cp.needed_len
                assert all(v == 1 for row in cover for v in row)


def test_no_plan_when_the_tile_has_no_interior():
    # a 2-row tile under a 5-wide window: every output reads a received row
    plans = plan_window_axis(8, 4, KernelAxis(5, 1, 1, 2, 2))
    assert plan_region_axis(plans[1], 5, 1) is None
    assert region_plan((plans[1], plans[1]), (5, 5), (1, 1)) is None


def test_image_borders_are_interior_only_inner_borders_make_bands():
    stem, pool = KernelAxis(7, 2, 1, 3, 3), KernelAxis(3, 2, 1, 1, 1)
    whole = plan_window_axis(2048, 1, stem)[0]
    region = plan_region_axis(whole, stem.span, stem.stride)
    assert region is not None and region.aligned and region.interior == (0, 1024)
    top, bottom = plan_window_axis(1024, 2, pool)
    plan = region_plan((top, whole_pool := plan_window_axis(1024, 1, pool)[0]), (3, 3), (2, 2), (1, 1))
    assert plan is not None and plan.aligned and whole_pool.pad_before == 1
    assert plan.bands == ()   # its windows end inside the tile: nothing received, all interior
    plan = region_plan((bottom, whole_pool), (3, 3), (2, 2), (1, 1))
    assert plan is not None and [out for out, _ in plan.bands] == [((0, 1), (0, 512))]
