"""The window viewer: which rank computes each (shifted) window and how many tokens each rank sends it, as the
geometry says, drawn over an image or a blank canvas, a volume's grid one token slice at a time (Agg)."""

from __future__ import annotations

import numpy as np
import pytest

from mpi4dl_nb.notebook.viz import find_artists
from mpi4dl_nb.notebook.window_view import WindowGathers, draw_window_gathers
from mpi4dl_nb.spatial.geometry import TileGrid


def _tokens_by_rank(fig, window: int) -> dict[int, int]:
    """Gathered tokens drawn for ``window``, counted by the rank in their gid."""
    found: dict[int, int] = {}
    for artist in find_artists(fig, f"token:{window}:"):
        rank = int(artist.get_gid().rsplit(":", 1)[1])
        found[rank] = found.get(rank, 0) + 1
    return found


def test_swin_t_stage_4_at_224_px_gathers_its_one_window_from_all_four_ranks():
    gathers = WindowGathers.of(TileGrid(2, 2), (7, 7), (7, 7))       # 7 tokens: rows 4 + 3, cols 4 + 3
    assert gathers.layout.straddling() == [0]
    assert gathers.counts(0) == {0: 16, 1: 12, 2: 12, 3: 9} and gathers.owner(0) == 0
    caption = ("window 0: computed on rank 0, 16 tokens from rank 0, 12 tokens from rank 1, 12 tokens from rank 2, "
               "9 tokens from rank 3")
    assert gathers.caption(0) == caption
    fig = draw_window_gathers(gathers, np.zeros((224, 224, 3)))
    assert _tokens_by_rank(fig, 0) == gathers.counts(0)
    assert fig.axes[0].get_xlabel().replace("\n    ", " ") == caption
    assert [a.get_text() for a in find_artists(fig, "window-label:")] == ["w0\u2192r0"]
    assert len(find_artists(fig, "tile:")) == 4 and find_artists(fig, "image")


def test_stage_1_unshifted_has_no_straddling_window_and_shifted_ones_straddle_the_seams():
    plain = WindowGathers.of(TileGrid(2, 2), (56, 56), (7, 7))
    assert plain.layout.straddling() == []
    fig = draw_window_gathers(plain)
    assert not find_artists(fig, "token:") and "no window straddles" in fig.axes[0].get_xlabel()
    assert len(find_artists(fig, "window-edges")[0].get_segments()) == 2 * 7 * 56    # 7 inner edges per axis
    shifted = WindowGathers.of(TileGrid(2, 2), (56, 56), (7, 7), (3, 3))
    straddling = shifted.layout.straddling()
    assert len(straddling) == 16 + 16 - 4            # window rows 3, 7 and cols 3, 7 cross a seam (7: the wrap)
    assert shifted.counts(3) == {0: 28, 1: 21} and shifted.owner(3) == 0    # cols 24..30 across the seam at 28
    assert shifted.padding(3) == 0
    fig = draw_window_gathers(shifted, window=3)
    assert _tokens_by_rank(fig, 3) == {0: 28, 1: 21}
    assert fig.axes[0].get_xlabel() == shifted.caption(3)
    # drawn in original coordinates: the last window wraps around, holding the 4 corners of the grid
    tokens = {c for c in shifted.windows.sources(63) if c is not None}
    assert {(0, 0), (2, 2), (55, 55), (52, 52), (0, 55)} <= tokens and not {(3, 3), (51, 51)} & tokens
    assert shifted.counts(63) == {0: 9, 1: 12, 2: 12, 3: 16} and shifted.owner(63) == 3
    corners = {artist.get_xy() for artist in find_artists(draw_window_gathers(shifted, window=63), "token:63:")}
    assert len(corners) == 49 and {(0.0, 0.0), (55.0, 55.0), (55.0, 0.0)} <= corners


def test_padding_slots_are_counted_apart():
    gathers = WindowGathers.of(TileGrid(1, 2), (5, 6), (4, 4))      # padded to 8 x 8: windows 2 x 2
    assert gathers.counts(0) == {0: 12, 1: 4} and gathers.padding(0) == 0         # cols 0..2 | 3 of tile 1
    assert gathers.counts(1) == {1: 8} and gathers.padding(1) == 8                # cols 4, 5 and 2 padded
    assert gathers.counts(3) == {1: 2} and gathers.caption(3).endswith(", 14 padding slots")


def test_a_volume_grid_draws_one_token_slice_and_counts_whole_windows():
    gathers = WindowGathers.of(TileGrid(2, 2, depth=2), (8, 8, 8), (4, 4, 4), (2, 2, 2))
    assert gathers.layout.straddling() == list(range(8))
    assert gathers.counts(0) == {rank: 8 for rank in range(8)}              # 2 x 2 x 2 tokens from each tile
    assert sorted(gathers.owner(w) for w in range(8)) == list(range(8))     # one window per tile
    fig = draw_window_gathers(gathers, np.zeros((8, 16, 16)), window=0, depth_index=3)
    in_slice = [c for c in gathers.windows.sources(0) if c is not None and c[0] == 3]
    assert len(find_artists(fig, "token:0:")) == len(in_slice) == 16
    assert set(_tokens_by_rank(fig, 0)) == {0, 1, 2, 3}                     # slice 3: the front tiles
    assert sorted(int(a.get_gid().split(":")[1]) for a in find_artists(fig, "tile:")) == [0, 1, 2, 3]
    assert "token slice 3 of 8" in fig.axes[0].get_title()
    back = draw_window_gathers(gathers, window=0, depth_index=4)
    assert set(_tokens_by_rank(back, 0)) == {4, 5, 6, 7}


@pytest.mark.parametrize(("make", "match"), [
    (lambda: WindowGathers.of(TileGrid(2, 2), (7, 7, 7), (7, 7, 7)), "token grid sizes"),
    (lambda: WindowGathers.of(TileGrid(2, 2), (7, 7), (7, 7), (7, 0)), "0 <= shift < window"),
    (lambda: WindowGathers.of(TileGrid(2, 2), (1, 7), (1, 7)), "every tile needs a token"),
    (lambda: WindowGathers.of(TileGrid(2, 2), (7, 7), (7, 7)).caption(1), "windows 0 .. 0"),
    (lambda: draw_window_gathers(WindowGathers.of(TileGrid(2, 2), (7, 7), (7, 7)), depth_index=0),
     "needs a volume's grid"),
    (lambda: draw_window_gathers(WindowGathers.of(TileGrid(1, 1, depth=2), (4, 4, 4), (2, 2, 2)), depth_index=4),
     "slices 0 .. 3"),
])
def test_bad_input_is_refused_naming_what_is_wrong(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_the_widget_redraws_for_typed_sizes_and_shows_a_bad_one_as_its_error():
    from mpi4dl_nb.notebook.widgets import WindowViewer

    viewer = WindowViewer(TileGrid(2, 2), (16, 16), window=4)
    assert viewer.gathers is not None and viewer.view.shown and not find_artists(viewer.view.figure, "token:")
    viewer.shift.value = 2                                    # shifted: window rows 1, 3 and cols 1, 3 straddle
    assert len(viewer.gathers.layout.straddling()) == 8 + 8 - 4 and "12 straddle" in viewer.status.value
    assert {int(a.get_gid().split(":")[1]) for a in find_artists(viewer.view.figure, "token:")} == set(
        viewer.gathers.layout.straddling())
    viewer.window.value = 15
    assert _tokens_by_rank(viewer.view.figure, 15) == viewer.gathers.counts(15) == {0: 4, 1: 4, 2: 4, 3: 4}
    viewer.size.value = 2                                     # shift 2 is not below window 2
    assert viewer.gathers is None and "0 <= shift < window" in (viewer.error or "") and not viewer.view.shown
    viewer.shift.value = 1
    assert viewer.gathers is not None and viewer.window.value == -1 and viewer.view.shown
    volume = WindowViewer(TileGrid(2, 2, depth=2), (8, 8, 8), window=4, shift=2)
    volume.depth.value = 5
    assert "token slice 5 of 8" in volume.view.figure.axes[0].get_title()
