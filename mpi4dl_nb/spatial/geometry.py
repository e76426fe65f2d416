"""Pure tile geometry: grids, ownership ranges, and per-layer halo plans (no MPI, no torch).

Rules (DistDL style): every tensor of spatial size ``n`` split over ``parts`` tiles along an
axis is owned by the *balanced split* — the first ``n % parts`` tiles get one extra row.
Because ownership depends only on the tensor size, two branches that produce the same size
(a stride-2 3x3 conv and a stride-2 1x1 downsample) own the same ranges, so residual adds
and element-wise ops work tile by tile. A windowed layer (conv/pool) owning output range
``[o0, o1)`` needs input ``[o0*s - p_before, (o1-1)*s - p_before + d*(k-1) + 1)``; the
needed range minus the owned range is the halo per side (negative = trim). Needed rows
outside the image are the layer's padding; rows inside come from the tile itself or from
its immediate neighbour — anything farther is refused with a ``ConfigError``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ..config import ConfigError, SliceMethod, as_slice_method, volume_slices

Range = tuple[int, int]   # half-open [start, stop)
Box = tuple[int, int, int, int]   # half-open (r0, r1, c0, c1)


def split_ranges(size: int, parts: int) -> list[Range]:
    """Balanced split of ``range(size)`` into ``parts`` ranges: the first ``size % parts`` get +1."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(size, parts)
    ranges, start = [], 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


@dataclass(frozen=True)
class KernelAxis:
    """A sliding window along one axis: kernel, stride, dilation and padding before/after."""

    kernel: int = 1
    stride: int = 1
    dilation: int = 1
    pad_before: int = 0
    pad_after: int = 0

    def __post_init__(self) -> None:
        if self.kernel < 1 or self.stride < 1 or self.dilation < 1:
            raise ValueError(f"kernel, stride and dilation must be >= 1: {self}")
        if self.pad_before < 0 or self.pad_after < 0:
            raise ValueError(f"padding must be >= 0: {self}")

    @property
    def span(self) -> int:
        """Rows one output reads: ``dilation*(kernel-1) + 1``."""
        return self.dilation * (self.kernel - 1) + 1

    def out_size(self, size: int) -> int:
        """Output length for input length ``size`` (floor mode, like PyTorch)."""
        return (size + self.pad_before + self.pad_after - self.span) // self.stride + 1

    def needed(self, out_range: Range) -> Range:
        """Input range (image coordinates, may leave the image) that outputs ``out_range`` read."""
        o0, o1 = out_range
        if o1 <= o0:
            return (o0 * self.stride - self.pad_before, o0 * self.stride - self.pad_before)
        return (o0 * self.stride - self.pad_before,
                (o1 - 1) * self.stride - self.pad_before + self.span)


IDENTITY = KernelAxis()


@dataclass(frozen=True)
class AxisExchange:
    """What one tile owns, needs, receives and sends along one axis for one exchange.

    All ranges are in image coordinates of the exchanged tensor (length ``size``).
    ``needed`` may leave ``[0, size)``: the outside part is padding (``pad_before`` /
    ``pad_after`` rows). ``recv_prev``/``recv_next`` come from the previous/next tile,
    ``keep`` is the part of the own rows used (its difference from ``owned`` is the trim),
    ``send_prev``/``send_next`` are own rows the neighbours need.
    """

    index: int
    parts: int
    size: int
    owned: Range
    needed: Range
    keep: Range
    recv_prev: Range
    recv_next: Range
    send_prev: Range
    send_next: Range

    @property
    def pad_before(self) -> int:
        return max(0, -self.needed[0]) if self.needed[1] > self.needed[0] else 0

    @property
    def pad_after(self) -> int:
        return max(0, self.needed[1] - self.size) if self.needed[1] > self.needed[0] else 0

    @property
    def halo_before(self) -> int:
        """Rows added before the owned range (negative: trimmed), padding included."""
        return self.owned[0] - self.needed[0]

    @property
    def halo_after(self) -> int:
        return self.needed[1] - self.owned[1]

    @property
    def needed_len(self) -> int:
        return self.needed[1] - self.needed[0]

    @property
    def is_trivial(self) -> bool:
        """Nothing to do: the tile needs exactly what it owns and sends nothing."""
        return (self.needed == self.owned and range_length(self.send_prev) == 0
                and range_length(self.send_next) == 0)

    def offset(self, position: int) -> int:
        """Index inside the exchanged (needed) tensor of image row ``position``."""
        return position - self.needed[0]


def range_length(r: Range) -> int:
    """How many positions the half-open range ``r`` holds (0 when empty)."""
    return max(0, r[1] - r[0])


def _data(plan: AxisExchange) -> Range:
    """The part of ``plan``'s needed range inside the tensor (the rest is padding)."""
    return (max(plan.needed[0], 0), min(plan.needed[1], plan.size))


AXIS_NAMES = ("depth", "rows", "cols")   # a grid's axes, outermost first (2-D grids: the last two)


def _range(r: Sequence[int]) -> Range:
    return (int(r[0]), int(r[1]))


def plan_axis(size: int, owned: Sequence[Range], needed: Sequence[Range], *,
              knob: str = "num_spatial_parts", what: str = "layer") -> list[AxisExchange]:
    """Exchange plan of every tile along one axis, given owned and needed ranges per tile.

    Raises ``ConfigError`` when a tile needs rows that neither it nor an adjacent tile owns.
    """
    parts = len(owned)
    recv: list[tuple[Range, Range, Range]] = []
    for index, ((s, e), (a, b)) in enumerate(zip(owned, needed)):
        lo, hi = max(a, 0), min(b, size)
        if hi <= lo:
            recv.append(((s, s), (s, s), (e, e)))
            continue
        prev_r = (lo, min(s, hi)) if lo < s else (s, s)
        keep = (max(s, lo), min(e, hi))
        if keep[1] <= keep[0]:
            keep = (s, s)
        next_r = (max(e, lo), hi) if hi > e else (e, e)
        if range_length(prev_r) and (index == 0 or prev_r[0] < owned[index - 1][0]):
            raise ConfigError(knob, f"{what}: tile {index} of {parts} along an axis of {size} "
                              f"needs rows {prev_r} but its previous neighbour owns only "
                              f"{owned[index - 1] if index else 'nothing'}; the halo is wider "
                              f"than a tile — use fewer spatial parts or a larger image_size")
        if range_length(next_r) and (index == parts - 1 or next_r[1] > owned[index + 1][1]):
            raise ConfigError(knob, f"{what}: tile {index} of {parts} along an axis of {size} "
                              f"needs rows {next_r} but its next neighbour owns only "
                              f"{owned[index + 1] if index < parts - 1 else 'nothing'}; the halo "
                              f"is wider than a tile — use fewer spatial parts or a larger "
                              f"image_size")
        recv.append((prev_r, keep, next_r))
    plans = []
    for index in range(parts):
        prev_r, keep, next_r = recv[index]
        start, stop = _range(owned[index])
        send_prev = recv[index - 1][2] if index > 0 else (start, start)
        send_next = recv[index + 1][0] if index < parts - 1 else (stop, stop)
        plans.append(AxisExchange(index, parts, size, (start, stop), _range(needed[index]),
                                  keep, prev_r, next_r, send_prev, send_next))
    return plans


def plan_window_axis(size: int, parts: int, window: KernelAxis, *,
                     knob: str = "num_spatial_parts", what: str = "layer") -> list[AxisExchange]:
    """Per-tile exchange plan for a windowed layer on an axis of ``size`` split in ``parts``."""
    out = window.out_size(size)
    if out < parts:
        raise ConfigError(knob, f"{what}: output length {out} (input {size}) cannot be split "
                          f"into {parts} non-empty tiles; use at most {max(out, 1)} parts along "
                          f"this axis or a larger image_size")
    if size < parts:
        raise ConfigError(knob, f"{what}: input length {size} cannot be split into {parts} "
                          f"tiles; use a larger image_size")
    owned_out = split_ranges(out, parts)
    needed = [window.needed(r) for r in owned_out]
    return plan_axis(size, split_ranges(size, parts), needed, knob=knob, what=what)


class TileGrid:
    """A rows x cols grid of tiles (or, with ``depth``, a depth x rows x cols grid of a volume's
    tiles), numbered row-major over its axes (2-D: tile ``t`` at ``(t // cols, t % cols)``).

    ``TileGrid.from_slice_method``: ``"square"`` is sqrt(P) x sqrt(P) (P a perfect square),
    ``"vertical"`` is 1 row x P columns (vertical cuts), ``"horizontal"`` is P rows x 1 column
    (horizontal cuts). A grid made with ``depth`` (even ``depth=1``) tiles the last three dims
    ``(D, H, W)`` of its tensors; without it, the last two.
    """

    def __init__(self, rows: int, cols: int, depth: int | None = None) -> None:
        counts = (rows, cols) if depth is None else (depth, rows, cols)
        if any(int(n) != n or n < 1 for n in counts):
            shown = " x ".join(str(n) for n in counts)
            raise ConfigError("num_spatial_parts", f"a tile grid needs at least one tile along every "
                              f"axis (depth, rows, cols), got {shown}")
        self.rows = int(rows)
        self.cols = int(cols)
        self.depth = 1 if depth is None else int(depth)
        self.shape: tuple[int, ...] = tuple(int(n) for n in counts)

    @property
    def ndim(self) -> int:
        """How many trailing dims of a tensor the grid tiles: 2 (rows, cols) or 3 (depth, rows, cols)."""
        return len(self.shape)

    @property
    def volumetric(self) -> bool:
        return self.ndim == 3

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The grid's axes, outermost first: ``("rows", "cols")`` or ``("depth", "rows", "cols")``."""
        return AXIS_NAMES[-self.ndim:]

    @classmethod
    def from_slice_method(cls, method: SliceMethod | str, num_parts: int) -> TileGrid:
        """The grid MPI4DL's ``--slice-method`` and ``--num-spatial-parts`` describe (``"DxRxC"``: a volume's
        depth x rows x cols grid, D*R*C = ``num_parts``)."""
        if num_parts < 1:
            raise ConfigError("num_spatial_parts", f"must be >= 1, got {num_parts}")
        volume = volume_slices(method)
        if volume is not None:
            depth, rows, cols = volume
            if depth * rows * cols != num_parts:
                raise ConfigError("slice_method", f"{depth}x{rows}x{cols} has {depth * rows * cols} tiles but "
                                  f"num_spatial_parts={num_parts}; use num_spatial_parts={depth * rows * cols}")
            return cls(rows, cols, depth)
        kind = as_slice_method(method)
        root = math.isqrt(num_parts)
        if kind is SliceMethod.SQUARE and root * root != num_parts:
            lower, upper = root * root, (root + 1) * (root + 1)
            raise ConfigError("num_spatial_parts", f"slice_method 'square' needs a perfect "
                              f"square, got {num_parts}; use {lower} or {upper}, or "
                              f"slice_method 'vertical'/'horizontal'")
        return cls(*kind.grid_shape(num_parts))

    @classmethod
    def of_shape(cls, shape: Sequence[int]) -> TileGrid:
        """The grid of ``shape``: ``(rows, cols)`` or a volume's ``(depth, rows, cols)`` (``tile_grid_shape``)."""
        if len(shape) not in (2, 3):
            raise ValueError(f"a tile grid has 2 or 3 axes, got the shape {tuple(shape)}")
        *depth, rows, cols = shape
        return cls(rows, cols, depth[0] if depth else None)

    # ----------------------------------------------------------------- topology
    @property
    def num_tiles(self) -> int:
        return math.prod(self.shape)

    def position(self, tile: int) -> tuple[int, int]:
        """``(row, col)`` of ``tile`` (in a volume's grid: within its depth slice)."""
        self._check_tile(tile)
        return divmod(tile % (self.rows * self.cols), self.cols)

    def coords(self, tile: int) -> tuple[int, ...]:
        """``tile``'s index along every axis of the grid (``(depth, row, col)`` or ``(row, col)``)."""
        self._check_tile(tile)
        found = []
        for count in reversed(self.shape):
            tile, index = divmod(tile, count)
            found.append(index)
        return tuple(reversed(found))

    def tile_at_coords(self, coords: Sequence[int]) -> int | None:
        """Tile at ``coords`` (one index per axis), or None outside the grid."""
        tile = 0
        for index, count in zip(coords, self.shape):
            if not 0 <= index < count:
                return None
            tile = tile * count + index
        return tile

    def axis_neighbor(self, tile: int, axis: int, step: int) -> int | None:
        """Tile ``step`` places from ``tile`` along grid ``axis`` (None outside the grid)."""
        coords = list(self.coords(tile))
        coords[axis] += step
        return self.tile_at_coords(coords)

    def tile_at(self, row: int, col: int) -> int | None:
        """Tile at ``(row, col)`` of a 2-D grid (of a volume's grid: in depth slice 0), or None outside it."""
        if 0 <= row < self.rows and 0 <= col < self.cols:
            return row * self.cols + col
        return None

    def neighbor(self, tile: int, d_row: int, d_col: int) -> int | None:
        """Tile at offset ``(d_row, d_col)`` from ``tile``, in its depth slice (None outside the grid)."""
        *depth, row, col = self.coords(tile)
        return self.tile_at_coords((*depth, row + d_row, col + d_col))

    def neighbors(self, tile: int) -> dict[str, int]:
        """Existing neighbours by side: keys among 'top', 'bottom', 'left', 'right' and corners."""
        sides = {"top": (-1, 0), "bottom": (1, 0), "left": (0, -1), "right": (0, 1),
                 "top_left": (-1, -1), "top_right": (-1, 1), "bottom_left": (1, -1),
                 "bottom_right": (1, 1)}
        found = {}
        for name, (dr, dc) in sides.items():
            other = self.neighbor(tile, dr, dc)
            if other is not None:
                found[name] = other
        return found

    def _check_tile(self, tile: int) -> None:
        if not 0 <= tile < self.num_tiles:
            raise ValueError(f"tile {tile} outside a grid of {self.num_tiles} tiles")

    # ----------------------------------------------------------------- ownership
    def row_ranges(self, height: int) -> list[Range]:
        return split_ranges(height, self.rows)

    def col_ranges(self, width: int) -> list[Range]:
        return split_ranges(width, self.cols)

    def tile_box(self, tile: int, height: int, width: int) -> Box:
        """Half-open ``(r0, r1, c0, c1)`` that ``tile`` owns of a ``height x width`` map."""
        row, col = self.position(tile)
        r0, r1 = self.row_ranges(height)[row]
        c0, c1 = self.col_ranges(width)[col]
        return (r0, r1, c0, c1)

    def tile_boxes(self, height: int, width: int) -> list[Box]:
        return [self.tile_box(t, height, width) for t in range(self.num_tiles)]

    def full_size(self, tile_sizes: Sequence[Sequence[int]]) -> tuple[int, int]:
        """(height, width) of a map from every tile's ``(..., h, w)`` size, in tile order."""
        height = sum(int(tile_sizes[row * self.cols][-2]) for row in range(self.rows))
        width = sum(int(tile_sizes[col][-1]) for col in range(self.cols))
        return (height, width)

    def tile_of_size(self, tile: int, height: int, width: int) -> tuple[int, int]:
        r0, r1, c0, c1 = self.tile_box(tile, height, width)
        return (r1 - r0, c1 - c0)

    def extent(self, tile: int, sizes: Sequence[int]) -> tuple[Range, ...]:
        """The range ``tile`` owns along every tiled axis of a tensor whose tiled axes are ``sizes``."""
        self._check_axes(sizes)
        return tuple(split_ranges(int(size), count)[index]
                     for size, count, index in zip(sizes, self.shape, self.coords(tile)))

    def extents(self, sizes: Sequence[int]) -> list[tuple[Range, ...]]:
        return [self.extent(t, sizes) for t in range(self.num_tiles)]

    def full_lengths(self, tile_sizes: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """Lengths of the tiled axes from every tile's ``(..., *tiled)`` size, in tile order."""
        lengths = []
        for axis, count in enumerate(self.shape):
            along = [self.tile_at_coords([i if a == axis else 0 for a in range(self.ndim)])
                     for i in range(count)]
            lengths.append(sum(int(tile_sizes[t][axis - self.ndim]) for t in along if t is not None))
        return tuple(lengths)

    def check_sizes(self, sizes: Sequence[int]) -> None:
        """ConfigError unless every tile owns at least one position along every tiled axis."""
        self._check_axes(sizes)
        if any(size < count for size, count in zip(sizes, self.shape)):
            raise ConfigError("image_size", f"{'x'.join(map(str, sizes))} cannot be split into "
                              f"{' x '.join(map(str, self.shape))} non-empty tiles; use a larger "
                              f"image_size or fewer num_spatial_parts")

    def _check_axes(self, sizes: Sequence[int]) -> None:
        if len(sizes) != self.ndim:
            raise ValueError(f"{self} tiles {self.ndim} axes, got sizes {tuple(sizes)}")

    def check_size(self, height: int, width: int) -> None:
        """ConfigError unless every tile owns at least one row and column."""
        if height < self.rows or width < self.cols:
            raise ConfigError("image_size", f"{height}x{width} cannot be split into {self.rows} "
                              f"x {self.cols} non-empty tiles; use a larger image_size or fewer "
                              f"num_spatial_parts")

    # ------------------------------------------------------------------ layers
    def layer_halo(self, height: int, width: int, kernel: int | tuple[int, int] = 3,
                   stride: int | tuple[int, int] = 1, padding: int | tuple[int, int] = 0,
                   dilation: int | tuple[int, int] = 1, name: str = "layer") -> LayerHalo:
        """Halo geometry of a conv/pool layer on a ``height x width`` input (symmetric padding)."""
        k, s, p, d = (_pair(v) for v in (kernel, stride, padding, dilation))
        windows = [KernelAxis(k[a], s[a], d[a], p[a], p[a]) for a in range(2)]
        return LayerHalo.for_axis_windows(self, (height, width), windows, name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TileGrid) and self.shape == other.shape

    def __hash__(self) -> int:
        return hash(self.shape)

    def __repr__(self) -> str:
        depth = f"depth={self.depth}, " if self.volumetric else ""
        return f"TileGrid({depth}rows={self.rows}, cols={self.cols})"


def _pair(value: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(value, int):
        return (value, value)
    if len(value) != 2:
        raise ValueError(f"expected an int or a pair, got {tuple(value)}")
    return (int(value[0]), int(value[1]))


@dataclass(frozen=True)
class Message:
    """One halo message: ``src`` tile sends the ``extent`` (a range per tiled axis, image coordinates of the
    exchanged tensor) to ``dst`` in ``phase`` 'depth' (volumes: first), 'rows', then 'cols' (edges and corners
    included)."""

    phase: str
    src: int
    dst: int
    extent: tuple[Range, ...]

    @property
    def box(self) -> Box:
        """The extent's rows and columns ``(r0, r1, c0, c1)``."""
        return (*self.extent[-2], *self.extent[-1])

    @property
    def depth(self) -> Range | None:
        """The extent's depth range in a volume's exchange (None on an image's grid)."""
        return self.extent[0] if len(self.extent) == 3 else None

    @property
    def elements(self) -> int:
        return math.prod(range_length(r) for r in self.extent)


@dataclass(frozen=True)
class TileHalo:
    """One tile's view of one exchange: its plan along every tiled axis (outermost first) and the output
    range it computes along each."""

    tile: int
    axes: tuple[AxisExchange, ...]
    out_extent: tuple[Range, ...] = ()

    @property
    def rows(self) -> AxisExchange:
        return self.axes[-2]

    @property
    def cols(self) -> AxisExchange:
        return self.axes[-1]

    @property
    def depth(self) -> AxisExchange | None:
        """The depth axis' plan of a volume's exchange (None on an image's grid)."""
        return self.axes[0] if len(self.axes) == 3 else None

    @property
    def out_box(self) -> Box | None:
        return (*self.out_extent[-2], *self.out_extent[-1]) if self.out_extent else None

    @property
    def out_depth(self) -> Range | None:
        return self.out_extent[0] if len(self.out_extent) == 3 else None

    @property
    def owned_extent(self) -> tuple[Range, ...]:
        return tuple(axis.owned for axis in self.axes)

    @property
    def needed_extent(self) -> tuple[Range, ...]:
        return tuple(axis.needed for axis in self.axes)

    @property
    def owned_box(self) -> Box:
        return (*self.rows.owned, *self.cols.owned)

    @property
    def needed_box(self) -> Box:
        return (*self.rows.needed, *self.cols.needed)

    @property
    def halo(self) -> dict[str, int]:
        """Rows/cols added per side (padding included; negative = trimmed)."""
        return {"top": self.rows.halo_before, "bottom": self.rows.halo_after,
                "left": self.cols.halo_before, "right": self.cols.halo_after}

    @property
    def padding(self) -> dict[str, int]:
        """Rows/cols of layer padding per side (tiles on the image border only)."""
        return {"top": self.rows.pad_before, "bottom": self.rows.pad_after,
                "left": self.cols.pad_before, "right": self.cols.pad_after}


@dataclass(frozen=True)
class LayerHalo:
    """Halo geometry of one exchange on a grid: per tile what it owns, needs, sends, receives.

    One phase per tiled axis, outermost first (an image's: rows, then columns; a volume's: depth, rows,
    columns). Phase ``k`` sends the strips along axis ``k`` over the needed range of the axes already
    exchanged and the owned range of the later ones, so edges and corners travel in the later phases without
    diagonal messages. ``plans[k][i]``: the plan of the tiles with index ``i`` along axis ``k``.
    """

    grid: TileGrid
    sizes: tuple[int, ...]       # the exchanged tensor's tiled axes, outermost first
    out_sizes: tuple[int, ...]   # the layer's output along them
    tiles: tuple[TileHalo, ...]
    name: str = "layer"
    plans: tuple[tuple[AxisExchange, ...], ...] = field(default=(), repr=False)

    @property
    def height(self) -> int:
        return self.sizes[-2]

    @property
    def width(self) -> int:
        return self.sizes[-1]

    @property
    def out_height(self) -> int:
        return self.out_sizes[-2]

    @property
    def out_width(self) -> int:
        return self.out_sizes[-1]

    @classmethod
    def for_axis_windows(cls, grid: TileGrid, sizes: Sequence[int], windows: Sequence[KernelAxis],
                         name: str = "layer") -> LayerHalo:
        """Halo geometry of a windowed layer along every tiled axis (an image's or a volume's grid)."""
        grid.check_sizes(sizes)
        if len(windows) != grid.ndim:
            raise ValueError(f"{name}: {len(windows)} windows for the {grid.ndim} axes of {grid}")
        plans = [plan_window_axis(size, count, window, what=f"{name} ({axis})")
                 for size, count, window, axis in zip(sizes, grid.shape, windows, grid.axis_names)]
        outs = [window.out_size(size) for size, window in zip(sizes, windows)]
        return cls.from_axis_plans(grid, sizes, outs, plans, name)

    @classmethod
    def for_windows(cls, grid: TileGrid, height: int, width: int, rows: KernelAxis,
                    cols: KernelAxis, name: str = "layer") -> LayerHalo:
        """``for_axis_windows`` of an image's grid, spelt per axis."""
        return cls.for_axis_windows(grid, (height, width), (rows, cols), name)

    @classmethod
    def from_axis_plans(cls, grid: TileGrid, sizes: Sequence[int], outs: Sequence[int],
                        plans: Sequence[Sequence[AxisExchange]], name: str = "layer") -> LayerHalo:
        """The exchange made of each axis' per-tile plans (input lengths ``sizes``, output lengths ``outs``;
        ``plans[k][i]``: tile index ``i`` along axis ``k``)."""
        tiles = tuple(TileHalo(tile, tuple(axis[i] for axis, i in zip(plans, grid.coords(tile))),
                               grid.extent(tile, outs)) for tile in range(grid.num_tiles))
        return cls(grid, tuple(int(n) for n in sizes), tuple(int(n) for n in outs), tiles, name,
                   tuple(tuple(axis) for axis in plans))

    def tile(self, tile: int) -> TileHalo:
        return self.tiles[tile]

    def messages(self, tile: int | None = None) -> list[Message]:
        """Every message of the exchange (or only those ``tile`` sends or receives): one phase per
        axis, outermost first; a phase sends its axis' strips over the data range (the needed range
        inside the tensor) of the axes already exchanged and the owned range of the others."""
        found = []
        for t in range(self.grid.num_tiles):
            axes = self.tiles[t].axes
            for k, phase in enumerate(self.grid.axis_names):
                for step, sent in ((-1, axes[k].send_prev), (1, axes[k].send_next)):
                    peer = self.grid.axis_neighbor(t, k, step)
                    if peer is None or not range_length(sent):
                        continue
                    extent = [_data(a) if j < k else a.owned for j, a in enumerate(axes)]
                    extent[k] = sent
                    found.append(Message(phase, t, peer, tuple(extent)))
        if tile is not None:
            found = [m for m in found if tile in (m.src, m.dst)]
        return found

    @property
    def message_count(self) -> int:
        return len(self.messages())

    def describe(self) -> str:
        """Human-readable table: per tile, owned/needed boxes, halo per side, messages."""
        def joined(values: Sequence[int]) -> str:
            return "x".join(map(str, values))

        lines = [f"{self.name}: {joined(self.sizes)} -> {joined(self.out_sizes)} on "
                 f"{joined(self.grid.shape)} tiles, {self.message_count} messages"]
        for th in self.tiles:
            if th.depth is None:
                lines.append(f"  tile {th.tile}: owns {th.owned_box} needs {th.needed_box} "
                             f"halo {th.halo} outputs {th.out_box}")
            else:
                lines.append(f"  tile {th.tile}: owns {th.owned_extent} needs {th.needed_extent} "
                             f"halo {th.halo} depth {th.depth.halo_before, th.depth.halo_after} "
                             f"outputs {(th.out_depth, th.out_box)}")
        for m in self.messages():
            depth = "" if m.depth is None else f" depth {m.depth}"
            lines.append(f"  {m.phase}: {m.src} -> {m.dst} box {m.box}{depth}")
        return "\n".join(lines)

    def __iter__(self) -> Iterator[TileHalo]:
        return iter(self.tiles)


@dataclass(frozen=True)
class FusedLevel:
    """One windowed layer of a fused block, for one tile along one axis.

    The layer reads ``needed`` (may leave the image: padding), of which it holds ``data``
    (``needed`` clipped to the image, computed redundantly by the previous layers), and
    computes outputs ``out``. ``owned_in`` is the tile's owned range of its input tensor.
    """

    needed: Range
    data: Range
    out: Range
    owned_in: Range
    in_size: int


def plan_fused_axis(size: int, parts: int, windows: Sequence[KernelAxis], *,
                    knob: str = "fused_layers", what: str = "fused block"
                    ) -> tuple[list[AxisExchange], list[list[FusedLevel]]]:
    """One exchange for a chain of windowed layers: the wide halo and each layer's ranges.

    Working back from the owned output of the last layer, each layer's needed input is the
    previous layer's output range (clipped to its tensor). Returns the exchange plan of
    the first input per tile and, per tile, the levels in forward order.
    """
    sizes = [size]
    for window in windows:
        sizes.append(window.out_size(sizes[-1]))
    if min(sizes) < parts:
        raise ConfigError(knob, f"{what}: a tensor of length {min(sizes)} cannot be split into "
                          f"{parts} tiles; use fewer spatial parts or a larger image_size")
    per_tile = []
    for index in range(parts):
        data_out = split_ranges(sizes[-1], parts)[index]
        levels: list[FusedLevel] = []
        for j in range(len(windows), 0, -1):
            needed = windows[j - 1].needed(data_out)
            data_in = (max(needed[0], 0), min(needed[1], sizes[j - 1]))
            if data_in[1] <= data_in[0]:
                raise ConfigError(knob, f"{what}: tile {index} reads only padding at layer {j}; "
                                  f"use a smaller fused_layers")
            levels.insert(0, FusedLevel(needed, data_in, data_out,
                                        split_ranges(sizes[j - 1], parts)[index], sizes[j - 1]))
            data_out = data_in
        per_tile.append(levels)
    exchange = plan_axis(size, split_ranges(size, parts), [lv[0].needed for lv in per_tile],
                         knob=knob, what=f"{what} (one exchange for {len(windows)} layers; use a "
                                         f"smaller fused_layers)")
    return exchange, per_tile
