"""Volumes' tile grids (depth x rows x cols): numbering, ownership, three-phase halo plans (pure)."""

from __future__ import annotations

import itertools

import pytest

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.spatial.geometry import KernelAxis, LayerHalo, TileGrid, split_ranges

GRIDS = [(2, 2, 2), (1, 1, 4), (4, 1, 1), (3, 2, 1)]


def test_two_d_grids_are_unchanged():
    grid = TileGrid(2, 3)
    assert (grid.ndim, grid.volumetric, grid.shape, grid.num_tiles) == (2, False, (2, 3), 6)
    assert [grid.position(t) for t in range(6)] == [divmod(t, 3) for t in range(6)]
    assert grid.coords(4) == (1, 1) and grid.tile_at_coords((1, 2)) == 5
    assert repr(grid) == "TileGrid(rows=2, cols=3)" and grid == TileGrid(rows=2, cols=3)
    assert grid != TileGrid(2, 3, depth=1)   # a 1-deep volume grid tiles three axes, not two


@pytest.mark.parametrize("shape", GRIDS, ids=["x".join(map(str, g)) for g in GRIDS])
def test_volume_tiles_are_numbered_row_major_and_partition_the_volume(shape):
    depth, rows, cols = shape
    grid = TileGrid(depth=depth, rows=rows, cols=cols)
    assert grid.ndim == 3 and grid.num_tiles == depth * rows * cols
    assert repr(grid) == f"TileGrid(depth={depth}, rows={rows}, cols={cols})"
    order = list(itertools.product(range(depth), range(rows), range(cols)))
    assert [grid.coords(t) for t in range(grid.num_tiles)] == order
    assert all(grid.tile_at_coords(c) == t for t, c in enumerate(order))
    assert grid.tile_at_coords((depth, 0, 0)) is None and grid.tile_at_coords((0, -1, 0)) is None
    sizes = (7, 5, 9)   # uneven on every axis of every grid here
    owner: dict[tuple[int, int, int], int] = {}
    for tile, extent in enumerate(grid.extents(sizes)):
        for axis, (start, stop) in enumerate(extent):
            assert (start, stop) == split_ranges(sizes[axis], grid.shape[axis])[grid.coords(tile)[axis]]
        for voxel in itertools.product(*(range(*r) for r in extent)):
            assert voxel not in owner, f"voxel {voxel} owned twice"
            owner[voxel] = tile
    assert len(owner) == 7 * 5 * 9
    tile_sizes = [tuple(stop - start for start, stop in extent) for extent in grid.extents(sizes)]
    assert grid.full_lengths(tile_sizes) == sizes


def test_depth_neighbours_and_refusals():
    grid = TileGrid(depth=2, rows=2, cols=2)
    assert grid.axis_neighbor(0, 0, 1) == 4 and grid.axis_neighbor(4, 0, 1) is None
    assert grid.neighbor(5, 1, 0) == 7          # within its depth slice
    assert grid.position(6) == (1, 0)
    with pytest.raises(ConfigError, match="depth, rows, cols"):
        TileGrid(depth=0, rows=2, cols=2)
    with pytest.raises(ConfigError, match="image_size"):
        grid.check_sizes((1, 8, 8))
    with pytest.raises(ConfigError, match="depth"):
        LayerHalo.for_axis_windows(TileGrid(depth=4, rows=1, cols=1), (4, 8, 8), [KernelAxis(5, 1, 1, 2, 2)] * 3)


def _simulate(halo: LayerHalo) -> None:
    """Deliver the plan's messages phase by phase: every voxel a tile sends it holds by then (owned or
    received in an earlier phase: no diagonal messages), and in the end each tile holds its needed
    extent inside the volume, no message goes to a diagonal tile, none is empty."""
    grid = halo.grid
    held = [set(itertools.product(*(range(*r) for r in th.owned_extent))) for th in halo]
    for phase in ("depth", "rows", "cols"):
        arriving: list[set] = [set() for _ in held]
        for m in halo.messages():
            if m.phase != phase:
                continue
            assert m.elements > 0 and m.depth is not None
            differs = [a != b for a, b in zip(grid.coords(m.src), grid.coords(m.dst))]
            assert sum(differs) == 1 and ("depth", "rows", "cols")[differs.index(True)] == phase
            box = set(itertools.product(range(*m.depth), range(*m.box[:2]), range(*m.box[2:])))
            assert box <= held[m.src], f"{phase}: tile {m.src} sends voxels it does not hold"
            arriving[m.dst] |= box
        for mine, new in zip(held, arriving):
            mine |= new
    for th, mine in zip(halo, held):
        inside = [(max(a, 0), min(b, size)) for (a, b), size in zip(th.needed_extent, halo.sizes)]
        assert set(itertools.product(*(range(*r) for r in inside))) <= mine, f"tile {th.tile}"


@pytest.mark.parametrize("shape", GRIDS, ids=["x".join(map(str, g)) for g in GRIDS])
@pytest.mark.parametrize("kernel,stride,ceil", [(1, 1, False), (3, 1, False), (5, 1, False), (3, 2, False),
                                                (5, 2, True), (2, 2, True)])
def test_three_phase_plans_deliver_every_needed_voxel(shape, kernel, stride, ceil):
    grid = TileGrid(depth=shape[0], rows=shape[1], cols=shape[2])
    sizes = (12, 9, 13)
    pad = kernel // 2
    windows = [KernelAxis(kernel, stride, 1, pad, pad + (1 if ceil else 0)) for _ in sizes]
    halo = LayerHalo.for_axis_windows(grid, sizes, windows, name=f"k{kernel}s{stride}")
    assert halo.sizes == sizes and halo.out_sizes == tuple(w.out_size(n) for w, n in zip(windows, sizes))
    for th in halo:
        outs = grid.extent(th.tile, halo.out_sizes)
        assert (th.out_depth, th.out_box) == (outs[0], (*outs[1], *outs[2]))
        for axis, window, out in zip(th.axes, windows, outs):
            assert axis.needed == window.needed(out)
    _simulate(halo)
    assert f"on {'x'.join(map(str, shape))} tiles" in halo.describe()


def test_cube_of_tiles_sends_one_face_per_neighbour():
    grid = TileGrid(depth=2, rows=2, cols=2)
    halo = LayerHalo.for_axis_windows(grid, (6, 6, 6), [KernelAxis(3, 1, 1, 1, 1)] * 3)
    messages = halo.messages()
    assert len(messages) == 24 and {m.phase for m in messages} == {"depth", "rows", "cols"}
    # the last phase carries the edges and the corner: 4 x 4 rows (needed depth x needed rows) x 1 col
    assert [m.elements for m in messages if m.phase == "cols"] == [16] * 8
    assert [m.elements for m in messages if m.phase == "depth"] == [9] * 8
