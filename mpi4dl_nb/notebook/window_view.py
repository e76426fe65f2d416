"""Swin's (shifted) windows on token tiles: which rank computes each window and how many of its tokens each rank
sends it, drawn over an image or a blank canvas (a volume's grid: one depth slice), in viz.py's manner.

The geometry is ``spatial/windows/plan.py``'s (``ShiftedWindows``, ``TokenBoxes``, ``WindowLayout``); windows are drawn
where one process's rolled grid puts them, in the ORIGINAL token coordinates (a shifted window that wraps around
the grid's end shows as pieces). Artists carry a ``gid``: ``"tile:<t>"``, ``"window-edges"``,
``"token:<window>:<rank>"`` (a gathered token, coloured by the rank it comes from), ``"window-label:<window>"``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..spatial.geometry import TileGrid
from ..spatial.windows.plan import Coord, ShiftedWindows, TokenBoxes, WindowLayout
from .viz import _axes, as_picture, stage_color, volume_depth, volume_slice

if TYPE_CHECKING:
    import torch

CAPTION_LINES = 6      # windows named in a figure's caption; more are counted ("... and 5 more")


@dataclass(frozen=True)
class WindowGathers:
    """Windows of a token grid on a tile grid: the rank computing each (``WindowLayout``'s owner) and the tokens
    each rank sends it (its own included), padding slots apart."""

    layout: WindowLayout

    @classmethod
    def of(cls, grid: TileGrid, sizes: Sequence[int], window: Sequence[int],
           shift: Sequence[int] | None = None) -> WindowGathers:
        """The windows of ``window`` tokens per axis, rolled by ``-shift`` (default none), over a ``sizes`` token
        grid (one size per axis of ``grid``) held by ``grid``'s tiles in the balanced split."""
        boxes = TokenBoxes(grid, tuple(int(n) for n in sizes))
        if any(n < count for n, count in zip(boxes.sizes, grid.shape)):
            raise ValueError(f"a {boxes.sizes} token grid on {grid}: every tile needs a token on every axis")
        windows = ShiftedWindows(boxes.sizes, tuple(int(n) for n in window),
                                 tuple(0 for _ in boxes.sizes) if shift is None else tuple(int(s) for s in shift))
        return cls(WindowLayout(windows, boxes))

    @property
    def windows(self) -> ShiftedWindows:
        return self.layout.windows

    @property
    def boxes(self) -> TokenBoxes:
        return self.layout.boxes

    def check(self, index: int) -> None:
        if not 0 <= index < self.windows.num_windows:
            raise ValueError(f"window {index}: the grid has windows 0 .. {self.windows.num_windows - 1} "
                             f"({' x '.join(map(str, self.windows.counts))})")

    def owner(self, index: int) -> int:
        """The rank (tile) that computes window ``index``."""
        self.check(index)
        return self.layout.owners[index]

    def counts(self, index: int) -> dict[int, int]:
        """Tokens of window ``index`` each rank holds (ranks ascending; ranks with none left out)."""
        self.check(index)
        found: dict[int, int] = {}
        for coord in self.windows.sources(index):
            if coord is not None:
                rank = self.boxes.locate(coord)[0]
                found[rank] = found.get(rank, 0) + 1
        return dict(sorted(found.items()))

    def padding(self, index: int) -> int:
        """Padding slots of window ``index`` (zeros one process pads with: nobody sends them)."""
        self.check(index)
        return sum(coord is None for coord in self.windows.sources(index))

    def caption(self, index: int) -> str:
        """'window w: computed on rank r, k tokens from rank s, ...' (and its padding slots, if any)."""
        parts = [f"{k} tokens from rank {rank}" for rank, k in self.counts(index).items()]
        pad = self.padding(index)
        padded = f", {pad} padding slots" if pad else ""
        return f"window {index}: computed on rank {self.owner(index)}, {', '.join(parts)}{padded}"

    def chosen(self, window: int | None) -> list[int]:
        """The windows drawn: ``window`` alone, or (None) every straddling one."""
        if window is None:
            return self.layout.straddling()
        self.check(window)
        return [window]

    def window_ids(self, depth: int | None) -> np.ndarray:
        """The window holding each token of the (rows, cols) plane (a volume's: token slice ``depth``)."""
        rows, cols = self.boxes.sizes[-2:]
        prefix: Coord = () if depth is None else (depth,)
        return np.array([[self.windows.slot_of((*prefix, r, c))[0] for c in range(cols)] for r in range(rows)])


def draw_window_gathers(gathers: WindowGathers, image: np.ndarray | torch.Tensor | None = None, *,
                        window: int | None = None, depth_index: int | None = None,
                        ax: Axes | None = None) -> Figure:
    """The token grid (over ``image``, or a blank canvas), the tile boundaries, the windows' edges in original
    token coordinates, and the tokens of ``window`` (default: every straddling window) coloured by the rank they
    come from, each window labelled with the rank computing it; the captions (``WindowGathers.caption``) below.

    On a volume's grid, token slice ``depth_index`` (default 0) is drawn (over the volume's matching slice); the
    captions count whole windows, across every slice they span."""
    depth = _depth(gathers, depth_index)
    rows, cols = gathers.boxes.sizes[-2:]
    fig, ax = _axes(ax, (6, 6.8))
    sy, sx = _background(ax, gathers, image, depth)
    ids = gathers.window_ids(depth)
    ax.add_collection(LineCollection(_edges(ids, sy, sx), colors="white", linewidths=1.2, gid="window-edges"))
    chosen = gathers.chosen(window)
    for index in chosen:
        _draw_window(ax, gathers, index, depth, (sy, sx))
    for tile in _tiles_here(gathers, depth):
        (r0, r1), (c0, c1) = gathers.boxes.extents[tile][-2:]
        ax.add_patch(Rectangle((c0 * sx, r0 * sy), (c1 - c0) * sx, (r1 - r0) * sy, fill=False, edgecolor="black",
                               linewidth=2.5, gid=f"tile:{tile}"))
    ranks = sorted({rank for index in chosen for rank in gathers.counts(index)})
    if ranks:
        ax.legend(handles=[Patch(color=stage_color(r), label=f"from rank {r}") for r in ranks], fontsize=7,
                  loc="upper right")
    ax.set_xlim(0, cols * sx)
    ax.set_ylim(rows * sy, 0)
    ax.set_title(_title(gathers, depth, len(chosen), window), fontsize=9)
    ax.set_xlabel(_caption(gathers, chosen), fontsize=7, loc="left")
    return fig


def _depth(gathers: WindowGathers, depth_index: int | None) -> int | None:
    """The token slice drawn: None on an image's grid, ``depth_index`` (default 0) checked on a volume's."""
    grid = gathers.boxes.grid
    if not grid.volumetric:
        if depth_index is not None:
            raise ValueError(f"{grid} tiles images: depth_index {depth_index} needs a volume's grid (TileGrid with "
                             f"depth); leave it out to draw an image's token grid")
        return None
    depth = 0 if depth_index is None else depth_index
    if not 0 <= depth < gathers.boxes.sizes[0]:
        raise ValueError(f"depth_index {depth}: the token grid has slices 0 .. {gathers.boxes.sizes[0] - 1}")
    return depth


def _background(ax: Axes, gathers: WindowGathers, image: np.ndarray | torch.Tensor | None,
                depth: int | None) -> tuple[float, float]:
    """Draw the picture under the tokens (a volume's slice at token slice ``depth``), or a blank canvas; returns
    the picture pixels per token (rows, cols)."""
    rows, cols = gathers.boxes.sizes[-2:]
    if image is None:
        ax.add_patch(Rectangle((0, 0), cols, rows, facecolor="#F4F4F4", edgecolor="none", gid="canvas"))
        return 1.0, 1.0
    if depth is None:
        picture = as_picture(image)
    else:
        picture = volume_slice(image, depth * volume_depth(image) // gathers.boxes.sizes[0])
    height, width = picture.shape[:2]
    ax.imshow(picture, extent=(0, width, height, 0), cmap="gray" if picture.ndim == 2 else None, gid="image")
    return height / rows, width / cols


def _edges(ids: np.ndarray, sy: float, sx: float) -> list[list[tuple[float, float]]]:
    """Segments between neighbouring tokens of different windows (the windows' edges, wrapped pieces apart)."""
    segments = []
    rows, cols = ids.shape
    for r, c in zip(*np.nonzero(ids[:, 1:] != ids[:, :-1])):
        segments.append([((c + 1) * sx, r * sy), ((c + 1) * sx, (r + 1) * sy)])
    for r, c in zip(*np.nonzero(ids[1:, :] != ids[:-1, :])):
        segments.append([(c * sx, (r + 1) * sy), ((c + 1) * sx, (r + 1) * sy)])
    return segments


def _draw_window(ax: Axes, gathers: WindowGathers, index: int, depth: int | None,
                 scale: tuple[float, float]) -> None:
    """Window ``index``'s tokens in the drawn plane, each filled with its source rank's colour; a label naming the
    rank computing it on the window's first token in the plane."""
    sy, sx = scale
    here = [c for c in gathers.windows.sources(index) if c is not None and (depth is None or c[0] == depth)]
    for coord in here:
        rank = gathers.boxes.locate(coord)[0]
        r, c = coord[-2:]
        ax.add_patch(Rectangle((c * sx, r * sy), sx, sy, facecolor=stage_color(rank), alpha=0.55,
                               edgecolor="none", gid=f"token:{index}:{rank}"))
    if here:
        r, c = here[0][-2:]
        ax.text((c + 0.5) * sx, (r + 0.5) * sy, f"w{index}\u2192r{gathers.owner(index)}", fontsize=7,
                ha="left", va="center", gid=f"window-label:{index}",
                bbox={"facecolor": "white", "alpha": 0.8, "pad": 1})


def _tiles_here(gathers: WindowGathers, depth: int | None) -> list[int]:
    """The tiles owning the drawn plane (an image's grid: every tile)."""
    tiles = range(gathers.boxes.grid.num_tiles)
    if depth is None:
        return list(tiles)
    return [t for t in tiles if gathers.boxes.extents[t][0][0] <= depth < gathers.boxes.extents[t][0][1]]


def _title(gathers: WindowGathers, depth: int | None, drawn: int, window: int | None) -> str:
    windows = gathers.windows
    shape = "x".join(map(str, gathers.boxes.grid.shape))
    what = f"window {window}" if window is not None else f"{drawn} straddling windows"
    where = "" if depth is None else f", token slice {depth} of {gathers.boxes.sizes[0]}"
    return (f"{' x '.join(map(str, windows.sizes))} tokens on {shape} tiles{where}\n"
            f"windows {' x '.join(map(str, windows.window))}, shift {windows.shift}: {what}")


def _caption(gathers: WindowGathers, chosen: Sequence[int]) -> str:
    if not chosen:
        return "no window straddles tiles: every window is computed where its tokens are"
    lines = [textwrap.fill(gathers.caption(index), 110, subsequent_indent="    ")
             for index in chosen[:CAPTION_LINES]]
    if len(chosen) > CAPTION_LINES:
        lines.append(f"... and {len(chosen) - CAPTION_LINES} more")
    return "\n".join(lines)
