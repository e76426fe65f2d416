"""TileLayout and TileDim (pure): where a tile keeps the image's rows and columns through permutes,
reductions and flattening, and row/column counts that remember their axis."""

from __future__ import annotations

import copy
import pickle

import pytest

from mpi4dl_nb.spatial.tile_layout import (
    STANDARD,
    Axis,
    TileDim,
    TileLayout,
    flattened,
    moved_order,
    normalized_order,
    transposed_order,
)


def test_channels_last_and_back():
    nhwc = STANDARD.permuted([0, 2, 3, 1])
    assert nhwc == TileLayout(-3, -2) and not nhwc.standard
    assert nhwc.positions(4) == (1, 2)
    assert nhwc.permuted([0, 3, 1, 2]) is STANDARD          # back to the plain layout
    assert STANDARD.permuted([1, 0, 2, 3]) is STANDARD      # batch/channel swaps keep it
    assert STANDARD.permuted([0, 1, 3, 2]) == TileLayout(-1, -2)   # rows and columns swapped


@pytest.mark.parametrize("order,expected", [
    (transposed_order(1, -1, 4), [0, 3, 2, 1]),
    (moved_order([1], [-1], 4), [0, 2, 3, 1]),
    (moved_order([3, 0], [0, 1], 4), [3, 0, 1, 2]),
    (normalized_order([-1, 0], 4), [3, 0]),
])
def test_orders(order, expected):
    assert order == expected


def test_removing_other_dims_keeps_the_image_dims():
    nhwc = TileLayout(-3, -2)
    assert nhwc.without([3], 4) is STANDARD                  # a channel mean without keepdim: (N, H, W)
    assert STANDARD.without([0], 4) is STANDARD              # dims in front do not move them
    assert TileLayout(-4, -3).without([3, 4], 5) == TileLayout(-2, -1)


def test_flattened_rows_and_columns():
    flat = flattened((3, 5))
    assert flat.flat and flat.offsets == (-1,) and flat.lengths((2, 4, 15)) == (3, 5)
    moved = flat.permuted([0, 2, 1])                         # (N, H*W, C)
    assert moved == TileLayout(-2, -2, (3, 5)) and moved.positions(3) == (1,)
    assert "flattened" in moved.describe() and "rows in dim -3" in TileLayout(-3, -2).describe()


def test_fits_and_lengths():
    assert TileLayout(-3, -2).fits(3) and not TileLayout(-3, -2).fits(2)
    assert TileLayout(-3, -2).lengths((2, 7, 9, 4)) == (7, 9)


def test_tile_dims_are_ints_that_remember_their_axis():
    rows = TileDim(7, Axis.ROWS)
    assert rows == 7 and rows * 2 == 14 and type(rows * 2) is int    # arithmetic forgets the axis
    for copied in (copy.deepcopy(rows), pickle.loads(pickle.dumps(rows))):
        assert copied == 7 and copied.axis is Axis.ROWS
