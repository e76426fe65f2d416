"""Windows over an N-axis token grid on tiles: who computes each (shifted) window, the token gathers that bring
windows together and back, a cyclic roll's and a patch merge's gathers, Swin's mask labels (pure: no MPI, no torch).
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from ..geometry import Range, TileGrid

Coord = tuple[int, ...]            # a token's global coordinate, one index per axis (outermost first)
Locate = Callable[[Coord], tuple[int, int]]   # coordinate -> (tile, slot in that tile's buffer)
MASK_VALUE = -100.0                 # what Swin adds to the logits of token pairs from different regions


def row_major(lengths: Sequence[int]) -> Iterator[Coord]:
    """Every coordinate of a box of ``lengths``, last axis fastest."""
    return itertools.product(*(range(n) for n in lengths))


@dataclass(frozen=True)
class TokenBoxes:
    """The tokens of a ``sizes`` grid over ``grid``'s tiles (balanced split), row-major in each tile's box."""

    grid: TileGrid
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != self.grid.ndim:
            raise ValueError(f"{self.grid} tiles {self.grid.ndim} axes, got token grid sizes {self.sizes}")

    @cached_property
    def extents(self) -> list[tuple[Range, ...]]:
        """Each tile's range along every axis."""
        return self.grid.extents(self.sizes)

    @cached_property
    def _starts(self) -> list[list[int]]:
        """Per axis, the first index each tile position along it owns (for bisect)."""
        starts = []
        for axis in range(len(self.sizes)):
            seen = sorted({extent[axis][0] for extent in self.extents})
            starts.append(seen)
        return starts

    def lengths(self, tile: int) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.extents[tile])

    def count(self, tile: int) -> int:
        return math.prod(self.lengths(tile))

    def coords(self, tile: int) -> list[Coord]:
        """Global coordinates of ``tile``'s tokens in its row-major order."""
        origin = [start for start, _ in self.extents[tile]]
        return [tuple(o + i for o, i in zip(origin, local)) for local in row_major(self.lengths(tile))]

    def locate(self, coord: Coord) -> tuple[int, int]:
        """(tile, slot) of the token at global ``coord``."""
        positions = [bisect.bisect_right(starts, c) - 1 for starts, c in zip(self._starts, coord)]
        tile = self.grid.tile_at_coords(positions)
        if tile is None or not all(0 <= c < n for c, n in zip(coord, self.sizes)):
            raise ValueError(f"coordinate {coord} outside the {self.sizes} token grid")
        slot = 0
        for c, (start, stop) in zip(coord, self.extents[tile]):
            slot = slot * (stop - start) + (c - start)
        return tile, slot


@dataclass(frozen=True)
class TileGather:
    """One tile's part of a gather: ``size`` target slots (zeros where nothing is named), filled from its own
    ``source_size`` slots (``own_targets[i]`` <- ``own_sources[i]``) and from each peer (``receives``: peer tile,
    its target slots in message order); ``sends``: peer tile, own slots in the order that peer expects."""

    tile: int
    size: int
    source_size: int
    own_targets: tuple[int, ...]
    own_sources: tuple[int, ...]
    receives: tuple[tuple[int, tuple[int, ...]], ...]
    sends: tuple[tuple[int, tuple[int, ...]], ...]

    @property
    def tokens_sent(self) -> int:
        return sum(len(slots) for _, slots in self.sends)

    @property
    def tokens_received(self) -> int:
        return sum(len(slots) for _, slots in self.receives)

    @property
    def is_local(self) -> bool:
        return not self.sends and not self.receives


def plan_gather(targets: Sequence[Sequence[Coord | None]], locate: Locate,
                source_sizes: Sequence[int]) -> list[TileGather]:
    """Every tile's ``TileGather`` for ``targets[t]`` (what tile ``t`` wants, slot by slot; None: a zero)."""
    tiles = len(targets)
    receives: list[dict[int, list[int]]] = [{} for _ in range(tiles)]
    sends: list[dict[int, list[int]]] = [{} for _ in range(tiles)]
    own: list[tuple[list[int], list[int]]] = [([], []) for _ in range(tiles)]
    for tile, wanted in enumerate(targets):
        for slot, coord in enumerate(wanted):
            if coord is None:
                continue
            holder, source = locate(coord)
            if holder == tile:
                own[tile][0].append(slot)
                own[tile][1].append(source)
            else:
                receives[tile].setdefault(holder, []).append(slot)
                sends[holder].setdefault(tile, []).append(source)
    return [TileGather(tile, len(targets[tile]), source_sizes[tile], tuple(own[tile][0]), tuple(own[tile][1]),
                       tuple((peer, tuple(s)) for peer, s in sorted(receives[tile].items())),
                       tuple((peer, tuple(s)) for peer, s in sorted(sends[tile].items())))
            for tile in range(tiles)]


def roll_targets(boxes: TokenBoxes, shifts: Sequence[int]) -> list[list[Coord | None]]:
    """What each tile wants for ``torch.roll(x, shifts, dims=<grid axes>)``: slot ``p`` <- ``(p - shift) mod n``."""
    return [[tuple((c - s) % n for c, s, n in zip(coord, shifts, boxes.sizes)) for coord in boxes.coords(tile)]
            for tile in range(boxes.grid.num_tiles)]


def plan_roll(boxes: TokenBoxes, shifts: Sequence[int]) -> list[TileGather]:
    """The gather of a cyclic roll by ``shifts`` (one per axis): each tile sends ``|shift|`` slabs to its neighbour
    along each axis, the grid's last tile to its first (or back); nothing for zero shifts."""
    sizes = [boxes.count(t) for t in range(boxes.grid.num_tiles)]
    return plan_gather(roll_targets(boxes, shifts), boxes.locate, sizes)


def merge_offsets(axes: int) -> list[Coord]:
    """The 2x2 (2x2x2) neighbours a patch merge concatenates, in timm's order: the FIRST axis fastest
    (timm's ``reshape(B, H/2, 2, W/2, 2, C).permute(0, 1, 3, 4, 2, 5)``: (0,0), (1,0), (0,1), (1,1))."""
    return [tuple(reversed(offset)) for offset in row_major((2,) * axes)]


def merge_targets(boxes: TokenBoxes, offsets: Sequence[Coord] | None = None) -> list[list[Coord | None]]:
    """What each tile of the merged grid (``ceil(n / 2)`` per axis, balanced split) wants: for each of its tokens, the
    neighbours ``2 * p + offset`` in ``offsets`` order (None past the grid's end: one process pads with zeros)."""
    offsets = list(offsets) if offsets is not None else merge_offsets(len(boxes.sizes))
    merged = TokenBoxes(boxes.grid, tuple((n + 1) // 2 for n in boxes.sizes))
    wanted: list[list[Coord | None]] = []
    for tile in range(boxes.grid.num_tiles):
        slots: list[Coord | None] = []
        for coord in merged.coords(tile):
            for offset in offsets:
                source = tuple(2 * c + o for c, o in zip(coord, offset))
                slots.append(source if all(s < n for s, n in zip(source, boxes.sizes)) else None)
        wanted.append(slots)
    return wanted


def plan_merge(boxes: TokenBoxes, offsets: Sequence[Coord] | None = None) -> list[TileGather]:
    """The gather of a patch merge: each merged token's neighbours (``merge_targets``) brought to its tile."""
    sizes = [boxes.count(t) for t in range(boxes.grid.num_tiles)]
    return plan_gather(merge_targets(boxes, offsets), boxes.locate, sizes)


@dataclass(frozen=True)
class ShiftedWindows:
    """One process's windows: the grid rolled by ``-shift``, padded at each axis's end to a multiple of ``window``,
    cut into windows numbered row-major; a window's slots row-major."""

    sizes: tuple[int, ...]
    window: tuple[int, ...]
    shift: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.sizes) == len(self.window) == len(self.shift):
            raise ValueError(f"sizes {self.sizes}, window {self.window}, shift {self.shift}: one per axis")
        if any(w < 1 or not 0 <= s < w for w, s in zip(self.window, self.shift)):
            raise ValueError(f"window {self.window} and shift {self.shift}: 0 <= shift < window")

    @property
    def padded(self) -> tuple[int, ...]:
        return tuple(math.ceil(n / w) * w for n, w in zip(self.sizes, self.window))

    @property
    def counts(self) -> tuple[int, ...]:
        """Windows along each axis."""
        return tuple(p // w for p, w in zip(self.padded, self.window))

    @property
    def area(self) -> int:
        return math.prod(self.window)

    @property
    def num_windows(self) -> int:
        return math.prod(self.counts)

    @property
    def shifted(self) -> bool:
        return any(self.shift)

    def window_coords(self, index: int) -> Coord:
        found = []
        for count in reversed(self.counts):
            index, position = divmod(index, count)
            found.append(position)
        return tuple(reversed(found))

    def _positions(self, index: int) -> Iterator[Coord]:
        """Shifted, padded coordinates of window ``index``'s slots."""
        origin = [c * w for c, w in zip(self.window_coords(index), self.window)]
        return (tuple(o + i for o, i in zip(origin, local)) for local in row_major(self.window))

    def sources(self, index: int) -> list[Coord | None]:
        """The global (unrolled) coordinate of each slot of window ``index``; None for padding."""
        return [None if any(q >= n for q, n in zip(position, self.sizes)) else
                tuple((q + s) % n for q, s, n in zip(position, self.shift, self.sizes))
                for position in self._positions(index)]

    def slot_of(self, coord: Coord) -> tuple[int, int]:
        """(window, slot) holding the token at global ``coord``."""
        window, slot = 0, 0
        for c, s, n, w, count in zip(coord, self.shift, self.sizes, self.window, self.counts):
            q = (c - s) % n
            window, slot = window * count + q // w, slot * w + q % w
        return window, slot

    def _region(self, q: int, axis: int) -> int:
        """Swin's region of shifted, padded position ``q`` along ``axis``: 0 before the last window, 1 in it before
        the rolled-in part, 2 in the rolled-in part (one region when the axis is not shifted)."""
        if not self.shift[axis]:
            return 0
        padded, window = self.padded[axis], self.window[axis]
        return 0 if q < padded - window else 1 if q < padded - self.shift[axis] else 2

    def labels(self, index: int) -> list[int]:
        """Region label of each slot of window ``index``: Swin masks (``MASK_VALUE``) pairs of different labels."""
        return [sum(self._region(q, axis) * 3 ** (len(self.sizes) - 1 - axis) for axis, q in enumerate(position))
                for position in self._positions(index)]


@dataclass(frozen=True)
class WindowLayout:
    """Windows on tiles: each window on the tile holding most of its tokens (ties: the tied tile given the fewest
    windows so far, then the lowest, so evenly split windows spread over the tiles); the gathers
    from the tiles to the windows (``into_windows``) and back (``out_of_windows``; padding slots dropped)."""

    windows: ShiftedWindows
    boxes: TokenBoxes
    owners: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if self.windows.sizes != self.boxes.sizes:
            raise ValueError(f"windows over {self.windows.sizes}, tiles of {self.boxes.sizes}")
        owners: list[int] = []
        load = [0] * self.boxes.grid.num_tiles       # windows given to each tile so far
        for index in range(self.windows.num_windows):
            held = [0] * self.boxes.grid.num_tiles
            for coord in self.windows.sources(index):
                if coord is not None:
                    held[self.boxes.locate(coord)[0]] += 1
            most = max(held)
            owner = min((t for t in range(len(held)) if held[t] == most), key=lambda t: (load[t], t))
            load[owner] += 1
            owners.append(owner)
        object.__setattr__(self, "owners", tuple(owners))

    def owned(self, tile: int) -> list[int]:
        """The windows ``tile`` computes, in window order (its window buffer's order)."""
        return [w for w, owner in enumerate(self.owners) if owner == tile]

    def straddling(self) -> list[int]:
        """Windows whose tokens lie on more than one tile."""
        return [w for w in range(self.windows.num_windows)
                if len({self.boxes.locate(c)[0] for c in self.windows.sources(w) if c is not None}) > 1]

    def into_windows(self) -> list[TileGather]:
        """Tiles -> windows: tile ``t``'s buffer holds its owned windows' slots, window after window."""
        targets = [[c for w in self.owned(t) for c in self.windows.sources(w)]
                   for t in range(self.boxes.grid.num_tiles)]
        return plan_gather(targets, self.boxes.locate, [self.boxes.count(t) for t in range(len(targets))])

    def out_of_windows(self) -> list[TileGather]:
        """Windows -> tiles: each tile's tokens (row-major in its box) from the window slots that computed them."""
        tiles = self.boxes.grid.num_tiles
        position = {w: i for t in range(tiles) for i, w in enumerate(self.owned(t))}
        area = self.windows.area

        def locate(coord: Coord) -> tuple[int, int]:
            window, slot = self.windows.slot_of(coord)
            return self.owners[window], position[window] * area + slot

        targets: list[list[Coord | None]] = [list(self.boxes.coords(t)) for t in range(tiles)]
        return plan_gather(targets, locate, [len(self.owned(t)) * area for t in range(tiles)])

    def labels(self, tile: int) -> list[list[int]]:
        """The region labels of each window ``tile`` computes (``ShiftedWindows.labels``)."""
        return [self.windows.labels(w) for w in self.owned(tile)]
