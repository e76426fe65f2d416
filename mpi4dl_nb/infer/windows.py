"""Pure window geometry of streaming inference: receptive fields, window cores and inputs, per-rank boxes.

A fully convolutional network (FCN) maps an image of ``H x W`` pixels to ``H' x W'`` output
cells; cell ``j`` (per axis) reads input pixels ``[j*stride - before, j*stride + after)``
(its *field*; pixels outside the image are the layers' zero padding). The slide is walked in
windows: each window owns a *core* of output cells and reads the input range its core's
fields need, widened to multiples of ``align`` (every internal stride of the network divides
it, so the window's layers sit on the whole-image network's grid). Inside a window the
network pads at the window's edges; the cells whose field crosses an edge that is not the
slide's edge are wrong and lie outside the core, so every core cell equals the whole-image
network's cell. The geometry is per axis (``AxisWindows``): a slide's ``WindowPlan`` walks rows
and columns, a volume's ``BoxPlan`` depth, rows and columns, both over the same axis code. No
torch, no MPI.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..config import ConfigError
from ..spatial.geometry import Box, Range, TileGrid, split_ranges


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(value: int, multiple: int) -> int:
    return ceil_div(value, multiple) * multiple


@dataclass(frozen=True)
class AxisField:
    """How an output cell sees one input axis: cell ``j`` reads pixels ``[j*stride - before, j*stride + after)``.

    ``align``: window origins must be multiples of it (the product of the strides along every path).
    """

    stride: int
    before: int
    after: int
    align: int

    def __post_init__(self) -> None:
        if self.stride < 1 or self.align < 1:
            raise ValueError(f"stride and align must be >= 1: {self}")

    @property
    def unit(self) -> int:
        """Window input ranges start and end on multiples of this (pixels)."""
        return math.lcm(self.stride, self.align)

    @property
    def lead_cells(self) -> int:
        """Cells after a window's inner start edge whose field crosses it."""
        return max(0, ceil_div(self.before, self.stride))

    @property
    def trail_cells(self) -> int:
        """Cells before a window's inner end edge whose field crosses it."""
        return max(0, ceil_div(self.after, self.stride) - 1)

    @property
    def size(self) -> int:
        """Pixels one cell sees along this axis."""
        return self.before + self.after

    def input_range(self, core: Range, extent: int) -> Range:
        """Pixels a window whose core is ``core`` (cells) reads, inside ``[0, extent)``."""
        j0, j1 = core
        start = max(0, ((j0 - self.lead_cells) * self.stride) // self.unit * self.unit)
        stop = min(extent, round_up((j1 + self.trail_cells) * self.stride, self.unit))
        return (start, stop)

    def core_cells(self, input_pixels: int) -> int:
        """Core cells of an interior window reading at most ``input_pixels`` pixels."""
        slack = 2 * (self.unit - self.stride)   # rounding both ends out to the unit
        return (input_pixels - slack) // self.stride - self.lead_cells - self.trail_cells

    def min_input(self) -> int:
        """Fewest pixels an interior window may read along this axis (a one-cell core)."""
        return (1 + self.lead_cells + self.trail_cells) * self.stride + 2 * (self.unit - self.stride)

    def describe(self) -> str:
        return (f"cell j sees pixels [{self.stride}j - {self.before}, {self.stride}j + {self.after}) "
                f"({self.size} px)")


def check_window(window: int) -> None:
    if window < 1:
        raise ConfigError("--window", f"must be >= 1, got {window}")


@dataclass(frozen=True)
class AxisWindows:
    """The windows along one axis (``name``): cores and the input each reads.

    Cores split output cells ``[first, cells)`` evenly (sizes differ by at most one cell) into the
    fewest windows whose inputs fit ``parts`` ranks of ``window`` pixels; every input has the same
    length (``uniform_inputs``), the window's full size or the whole ``extent`` (pixels, a multiple
    of the field's unit). With ``fit_whole``, an axis whose whole extent fits one window's input is
    one window (no margin is needed where the window is the whole axis). A slide's rows and columns
    and a volume's depth, rows and columns are each one of these; a plan is their product.
    """

    name: str
    field: AxisField
    extent: int
    cells: int
    parts: int
    window: int
    first: int = 0
    fit_whole: bool = False

    def check(self) -> None:
        """ConfigError when one rank's ``window`` pixels cannot hold a one-cell core with its margin."""
        field = self.field
        if self.fits() or field.core_cells(self.parts * self.window) >= 1:
            return
        need = ceil_div(field.min_input(), self.parts)
        raise ConfigError("--window", f"{self.window} px per rank is too small: a window's {self.name} "
                          f"need {field.lead_cells + field.trail_cells} cells of receptive-field "
                          f"margin at stride {field.stride} ({field.describe()}), so each of the "
                          f"{self.parts} ranks along them needs >= {need} px; use --window >= {need}")

    def fits(self) -> bool:
        """One window's input holds the whole axis (and ``fit_whole`` asks for one window then)."""
        return self.fit_whole and self.parts * self.window >= self.extent

    def cores(self) -> list[Range]:
        cells = self.cells - self.first
        if cells <= 0:
            return []
        if self.fits():
            return [(self.first, self.cells)]
        count = ceil_div(cells, self.field.core_cells(self.parts * self.window))
        return [(self.first + a, self.first + b) for a, b in split_ranges(cells, count)]

    def full_length(self) -> int:
        """Every window's input length: all ``parts`` ranks' pixels (unit-aligned), or the whole axis."""
        return min(self.extent, self.parts * self.window // self.field.unit * self.field.unit)

    def inputs(self) -> list[Range]:
        return uniform_inputs(self.cores(), self.field, self.extent, self.full_length())


@dataclass(frozen=True)
class Window:
    """One window: its place in the window grid, its core (output cells) and its input box (pixels)."""

    row: int
    col: int
    core: Box          # (r0, r1, c0, c1) in output cells
    input: Box         # (y0, y1, x0, x1) in pixels of the (zero-extended) slide level
    stride: tuple[int, int]

    @property
    def input_size(self) -> tuple[int, int]:
        y0, y1, x0, x1 = self.input
        return (y1 - y0, x1 - x0)

    @property
    def core_in_output(self) -> Box:
        """The core in the window's own output (cell 0 = the cell at the input's origin)."""
        r0, r1, c0, c1 = self.core
        dy, dx = self.input[0] // self.stride[0], self.input[2] // self.stride[1]
        return (r0 - dy, r1 - dy, c0 - dx, c1 - dx)

    def rank_box(self, grid: TileGrid, tile: int) -> Box:
        """The pixels tile ``tile`` of ``grid`` reads (slide coordinates): the balanced split of the input."""
        y0, _, x0, _ = self.input
        r0, r1, c0, c1 = grid.tile_box(tile, *self.input_size)
        return (y0 + r0, y0 + r1, x0 + c0, x0 + c1)

    def core_footprint(self) -> Box:
        """Pixels of the slide the core's cells are anchored on: ``[r0*stride, r1*stride)`` per axis."""
        r0, r1, c0, c1 = self.core
        sy, sx = self.stride
        return (r0 * sy, r1 * sy, c0 * sx, c1 * sx)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None."""
    r0, r1 = max(a[0], b[0]), min(a[1], b[1])
    c0, c1 = max(a[2], b[2]), min(a[3], b[3])
    return (r0, r1, c0, c1) if r0 < r1 and c0 < c1 else None


@dataclass(frozen=True)
class WindowPlan:
    """The windows covering output rows ``[first_row, out_height)`` and every column, row by row.

    ``height x width`` is the slide level zero-extended to a multiple of each axis' unit;
    ``out_height x out_width`` the network's output on it. Cores split the output evenly
    (sizes differ by at most one cell) into the fewest windows whose inputs fit
    ``window`` pixels per rank (``grid`` ranks share a window).
    """

    height: int
    width: int
    out_height: int
    out_width: int
    rows: AxisField
    cols: AxisField
    grid: TileGrid
    window: int
    first_row: int = 0

    def __post_init__(self) -> None:
        check_window(self.window)
        for axis in (self.row_axis, self.col_axis):
            axis.check()
        for name, extent, field in (("height", self.height, self.rows), ("width", self.width, self.cols)):
            if extent % field.unit:
                raise ValueError(f"{name} {extent} is not a multiple of the window unit {field.unit}")
        if not 0 <= self.first_row <= self.out_height:
            raise ValueError(f"first_row {self.first_row} outside [0, {self.out_height}]")

    @property
    def row_axis(self) -> AxisWindows:
        return AxisWindows("rows", self.rows, self.height, self.out_height, self.grid.rows, self.window,
                           self.first_row)

    @property
    def col_axis(self) -> AxisWindows:
        return AxisWindows("columns", self.cols, self.width, self.out_width, self.grid.cols, self.window)

    @property
    def row_cores(self) -> list[Range]:
        return self.row_axis.cores()

    @property
    def col_cores(self) -> list[Range]:
        return self.col_axis.cores()

    def window_rows(self) -> Iterator[list[Window]]:
        """The windows, one list per window row, top to bottom."""
        col_cores, col_inputs = self.col_axis.cores(), self.col_axis.inputs()
        for i, (rc, ry) in enumerate(zip(self.row_axis.cores(), self.row_axis.inputs())):
            yield [Window(i, j, (*rc, *cc), (*ry, *cx), (self.rows.stride, self.cols.stride))
                   for j, (cc, cx) in enumerate(zip(col_cores, col_inputs))]

    def windows(self) -> list[Window]:
        return [w for row in self.window_rows() for w in row]

    @property
    def shape(self) -> tuple[int, int]:
        """Windows per column and per row."""
        return (len(self.row_cores), len(self.col_cores))

    def input_sizes(self) -> set[tuple[int, int]]:
        """The distinct window input sizes (each needs its halo plans once)."""
        return {w.input_size for w in self.windows()}


Extent = tuple[Range, ...]   # one half-open range per axis (a volume: depth, rows, columns)


@dataclass(frozen=True)
class BoxWindow:
    """One window of an N-axis plan: its place per axis, its core (output cells) and input (pixels) per axis."""

    index: tuple[int, ...]
    core: Extent
    input: Extent
    stride: tuple[int, ...]

    @property
    def input_size(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.input)

    @property
    def core_in_output(self) -> Extent:
        """The core in the window's own output (cell 0 = the cell at the input's origin)."""
        return tuple((c0 - i0 // s, c1 - i0 // s) for (c0, c1), (i0, _), s in zip(self.core, self.input, self.stride))

    def rank_extent(self, grid: TileGrid, tile: int) -> Extent:
        """The pixels tile ``tile`` of ``grid`` reads (volume coordinates): the balanced split of the input."""
        return tuple((i0 + a, i0 + b) for (i0, _), (a, b) in zip(self.input, grid.extent(tile, self.input_size)))


def intersect_extents(a: Extent, b: Extent) -> Extent | None:
    """The common part of two extents, or None."""
    common = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return common if all(lo < hi for lo, hi in common) else None


@dataclass(frozen=True)
class BoxPlan:
    """The windows of a volume (any number of axes): the product of its axes' windows, the last axis fastest."""

    axes: tuple[AxisWindows, ...]

    def __post_init__(self) -> None:
        for axis in self.axes:
            check_window(axis.window)
            axis.check()
            if axis.extent % axis.field.unit:
                raise ValueError(f"{axis.name} {axis.extent} is not a multiple of the window unit {axis.field.unit}")

    def windows(self) -> list[BoxWindow]:
        per_axis = [list(enumerate(zip(axis.cores(), axis.inputs()))) for axis in self.axes]
        stride = tuple(axis.field.stride for axis in self.axes)
        return [BoxWindow(tuple(i for i, _ in picks), tuple(core for _, (core, _) in picks),
                          tuple(box for _, (_, box) in picks), stride)
                for picks in itertools.product(*per_axis)]

    @property
    def shape(self) -> tuple[int, ...]:
        """Windows along every axis."""
        return tuple(len(axis.cores()) for axis in self.axes)

    def input_sizes(self) -> set[tuple[int, ...]]:
        return {w.input_size for w in self.windows()}


def uniform_inputs(cores: Sequence[Range], field: AxisField, extent: int, least: int = 0) -> list[Range]:
    """Each core's input range, widened inwards so that all have the longest one's length (at least ``least``).

    More context never changes a core cell (its field is inside either way), and one input
    size means one set of halo plans, kernel caches and batches for the whole slide; with
    ``least`` the window's full size, a rank's memory is the same on every slide larger than
    a window (a small slide's few windows are not shrunk to fit it).
    """
    natural = [field.input_range(core, extent) for core in cores]
    length = max((stop - start for start, stop in natural), default=0)
    length = max(length, least) if natural else length
    out = []
    for start, stop in natural:
        stop = min(extent, max(stop, start + length))
        out.append((stop - length, stop))
    return out


def batches(windows: Sequence[Window], limit: int) -> list[list[Window]]:
    """Consecutive windows of equal input size, at most ``limit`` per batch (one forward each)."""
    out: list[list[Window]] = []
    for window in windows:
        if out and len(out[-1]) < limit and out[-1][0].input_size == window.input_size:
            out[-1].append(window)
        else:
            out.append([window])
    return out


def padded_extent(size: int, unit: int) -> int:
    """A slide side zero-extended to a multiple of the window unit (the network's alignment)."""
    return round_up(size, unit)
