"""Pixel-exact polygons of a label map, traced strip of rows by strip (pure numpy): regions per class with holes.

The boundary of a class's region runs along pixel edges. Each unit edge between a pixel of
the class and one that is not is directed with the region on its left (x right, y down):
outer rings then have a positive enclosed pixel count, holes a negative one. At a vertex
where the region's pixels touch only diagonally the path turns left, so regions are
4-connected (pixels sharing an edge; diagonal ones are regions of their own, touching at a
point) and the rest 8-connected: a region's interior is then connected, as a valid polygon's
must be. A path passing a vertex twice is cut there into simple rings (a shell and a hole
touching it at that point, or two holes touching), so rings never cross or repeat a vertex
and every polygon is valid by the OGC rules (shapely, QuPath's JTS). Edges are collapsed into
straight runs; runs are linked into paths; a path still open at the strip's lower edge waits
for the next strip, so memory holds one strip and the paths crossing it, whatever the map's
height. A ring closing is emitted at once: a hole waits for the outer ring around it, which
closes later (it reaches lower).

Region sums come free with the tracing (Green's theorem on pixels): a vertical edge at
column ``x`` of row ``y`` adds ``+prefix`` (region on its left) or ``-prefix`` (on its right)
of the row's values left of ``x``; over a region's rings this is the sum of the values over
its pixels. With a channel of ones it is the pixel count.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

RIGHT, DOWN, LEFT, UP = 0, 1, 2, 3          # right turn: (d + 1) % 4
Vertex = tuple[int, int, "np.ndarray | None"]   # x, y, the sums of the run starting there (None: horizontal)


@dataclass(frozen=True)
class TracedRegion:
    """One traced region of a class: its outer ring, its holes (vertex arrays, map pixel corners) and sums."""

    label: int
    outer: np.ndarray                       # (n, 2) x, y; closed (first vertex repeated last)
    holes: tuple[np.ndarray, ...]
    sums: np.ndarray                        # per value channel, over the region's pixels
    area: float                             # pixels


@dataclass
class _Path:
    """A directed run of boundary edges: vertices from ``start`` on (``end`` not repeated), first/last direction."""

    start: int
    end: int
    first: int
    last: int
    points: deque[Vertex]
    sums: np.ndarray


@dataclass
class _Hole:
    probe: tuple[float, float]              # a point inside the region pixel next to the hole's first edge
    ring: np.ndarray
    sums: np.ndarray


BUCKET = 64   # pixels per side of the squares pending holes are filed under (by their probe point)


@dataclass
class _ClassState:
    pending: list[_Path] = field(default_factory=list)     # paths open at the last strip's lower edge
    holes: dict[tuple[int, int], list[_Hole]] = field(default_factory=dict)   # waiting for their outer ring

    def add(self, hole: _Hole) -> None:
        px, py = hole.probe
        self.holes.setdefault((int(py) // BUCKET, int(px) // BUCKET), []).append(hole)

    def take(self, ring: np.ndarray) -> list[_Hole]:
        """The waiting holes whose probe lies inside ``ring`` (removed)."""
        x0, y0 = int(ring[:, 0].min()) // BUCKET, int(ring[:, 1].min()) // BUCKET
        x1, y1 = int(ring[:, 0].max()) // BUCKET, int(ring[:, 1].max()) // BUCKET
        keys = ([(by, bx) for by in range(y0, y1 + 1) for bx in range(x0, x1 + 1) if (by, bx) in self.holes]
                if (y1 - y0 + 1) * (x1 - x0 + 1) < len(self.holes) else
                [k for k in self.holes if y0 <= k[0] <= y1 and x0 <= k[1] <= x1])
        candidates = [(key, hole) for key in keys for hole in self.holes[key]]
        if not candidates:
            return []
        inside = _contains(ring, np.array([hole.probe for _, hole in candidates]))
        taken = []
        for (key, hole), hit in zip(candidates, inside):
            if hit:
                taken.append(hole)
                self.holes[key].remove(hole)
                if not self.holes[key]:
                    del self.holes[key]
        return taken


def _runs(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs of equal non-zero codes along the last axis of a 2-D array: flat start index and length of each."""
    lines, length = codes.shape
    flat = codes.ravel()
    change = np.ones(flat.shape, dtype=bool)
    change[1:] = flat[1:] != flat[:-1]
    change[::length] = True
    starts = np.flatnonzero(change)
    ends = np.append(starts[1:], flat.size)
    keep = flat[starts] != 0
    return starts[keep], ends[keep] - starts[keep]


class RegionTracer:
    """Feed a label map strip by strip (``feed``), then ``finish``; each yields the regions that closed.

    ``labels``: int array, ``classes`` labels ``0..classes-1`` traced, anything else (e.g. -1) is
    no region. ``values``: float channels per pixel summed over each region (the ``TracedRegion.sums``).
    ``min_area``: regions and holes of fewer pixels are dropped (a dropped hole becomes part of its
    region).
    """

    def __init__(self, width: int, classes: int, channels: int, min_area: float = 0.0) -> None:
        self.width, self.classes, self.channels, self.min_area = width, classes, channels, min_area
        self.row = 0
        self.above = np.full(width, -1, dtype=np.int64)
        self.state = [_ClassState() for _ in range(classes)]

    def key(self, x: int, y: int) -> int:
        return y * (self.width + 1) + x

    def feed(self, labels: np.ndarray, values: np.ndarray) -> Iterator[TracedRegion]:
        """Rows ``[row, row + len(labels))``; ``values`` (channels, rows, width)."""
        rows = labels.shape[0]
        if rows == 0:
            return
        prefix = np.zeros((self.channels + 1, rows, self.width + 1))
        np.cumsum(np.nan_to_num(values, nan=0.0), axis=2, out=prefix[:-1, :, 1:])
        prefix[-1, :, 1:] = np.arange(1, self.width + 1)
        for label in range(self.classes):
            yield from self._strip(label, labels == label, self.above == label, prefix)
        self.above = labels[-1].astype(np.int64)
        self.row += rows

    def finish(self) -> Iterator[TracedRegion]:
        """Close every region at the map's lower edge."""
        empty = np.zeros((self.channels + 1, 0, self.width + 1))
        for label in range(self.classes):
            yield from self._strip(label, np.zeros((0, self.width), dtype=bool), self.above == label, empty)
            if self.state[label].pending or self.state[label].holes:
                raise RuntimeError(f"class {label}: boundary paths left open at the map's end")

    # ------------------------------------------------------------------ one class, one strip
    def _strip(self, label: int, mask: np.ndarray, above: np.ndarray, prefix: np.ndarray) -> Iterator[TracedRegion]:
        y0 = self.row
        rows = mask.shape[0]
        items: list[_Path] = list(self.state[label].pending)
        # horizontal edges on the lines y0 .. y0+rows-1 (and y0+rows at the end: rows == 0 means the last line)
        upper = np.vstack([above[None], mask[:-1]]) if rows else above[None]
        lower = mask if rows else np.zeros_like(above)[None]
        codes = np.where(upper & ~lower, 1, 0) + np.where(lower & ~upper, 2, 0)
        starts, lengths = _runs(codes.astype(np.int8))
        flat = codes.ravel()
        for start, length in zip(starts.tolist(), lengths.tolist()):
            y, x = divmod(start, self.width)
            y += y0
            if flat[start] == 1:
                items.append(self._segment(x, y, x + length, y, RIGHT))
            else:
                items.append(self._segment(x + length, y, x, y, LEFT))
        if rows:
            padded = np.zeros((rows, self.width + 2), dtype=bool)
            padded[:, 1:-1] = mask
            left, right = padded[:, :-1], padded[:, 1:]
            vcodes = (np.where(right & ~left, 1, 0) + np.where(left & ~right, 2, 0)).astype(np.int8)
            sign = np.where(vcodes == 1, -1.0, np.where(vcodes == 2, 1.0, 0.0))
            contrib = (prefix * sign[None]).transpose(0, 2, 1).reshape(prefix.shape[0], -1)
            by_column = np.ascontiguousarray(vcodes.T)
            starts, lengths = _runs(by_column)
            sums = np.add.reduceat(contrib, starts, axis=1) if starts.size else np.zeros((prefix.shape[0], 0))
            cflat = by_column.ravel()
            for index, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
                x, y = divmod(start, rows)
                y += y0
                if cflat[start] == 1:
                    items.append(self._segment(x, y, x, y + length, DOWN, sums[:, index]))
                else:
                    items.append(self._segment(x, y + length, x, y, UP, sums[:, index]))
        pending, closed = self._link(items)
        self.state[label].pending = pending
        yield from self._close(label, [loop for path in closed for loop in _loops(path.points, self.channels + 1)])

    def _segment(self, x0: int, y0: int, x1: int, y1: int, direction: int,
                 sums: np.ndarray | None = None) -> _Path:
        own = sums.copy() if sums is not None else None
        return _Path(self.key(x0, y0), self.key(x1, y1), direction, direction, deque([(x0, y0, own)]),
                     own if own is not None else np.zeros(self.channels + 1))

    @staticmethod
    def _link(items: list[_Path]) -> tuple[list[_Path], list[_Path]]:
        """Join paths end to start (left turn at a vertex with two ways on): (open paths, closed rings)."""
        outgoing: dict[int, list[int]] = {}
        for index, item in enumerate(items):
            outgoing.setdefault(item.start, []).append(index)
        successor: dict[int, int] = {}
        for index, item in enumerate(items):
            ways = outgoing.get(item.end)
            if not ways:
                continue
            if len(ways) == 1:
                successor[index] = ways[0]
            else:
                turn = (item.last + 3) % 4           # left: the region's diagonal pixels stay apart
                successor[index] = next(w for w in ways if items[w].first == turn)
        has_predecessor = set(successor.values())
        seen: set[int] = set()
        open_paths: list[_Path] = []
        rings: list[_Path] = []
        heads = [i for i in range(len(items)) if i not in has_predecessor]
        for head in heads + list(range(len(items))):
            if head in seen:
                continue
            chain = [head]
            seen.add(head)
            current = head
            while current in successor and successor[current] not in seen:
                current = successor[current]
                seen.add(current)
                chain.append(current)
            joined = _join([items[i] for i in chain])
            closed = current in successor and successor[current] == head
            (rings if closed else open_paths).append(joined)
        return open_paths, rings

    def _close(self, label: int, loops: list[tuple[np.ndarray, np.ndarray]]) -> Iterator[TracedRegion]:
        """Simple loops closed in one strip: holes first (they wait), then outer rings take their holes."""
        state = self.state[label]
        for ring, sums in loops:
            if sums[-1] < 0 and -sums[-1] >= self.min_area:      # a hole: waits for its outer ring
                (x, y), (nx, ny) = ring[0], ring[1]
                dx, dy = np.sign(nx - x), np.sign(ny - y)
                probe = (x + 0.5 * dx + 0.5 * dy, y + 0.5 * dy - 0.5 * dx)   # the region is on the edge's left
                state.add(_Hole(probe, ring, sums))
        for ring, sums in loops:
            if sums[-1] <= 0:
                continue
            mine = state.take(ring)
            total = sums + sum((h.sums for h in mine), np.zeros_like(sums))
            if total[-1] >= self.min_area:
                yield TracedRegion(label, ring, tuple(h.ring for h in mine), total[:-1], float(total[-1]))


def _loops(points: deque[Vertex], channels: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """A closed path cut into simple loops at the vertices it passes twice: (closed corner ring, sums) each."""
    stack: list[Vertex] = []
    where: dict[tuple[int, int], int] = {}
    pieces: list[list[Vertex]] = []
    for vertex in points:
        key = (vertex[0], vertex[1])
        if key in where:
            start = where[key]
            pieces.append(stack[start:])
            for gone in stack[start:]:
                del where[(gone[0], gone[1])]
            del stack[start:]
        where[key] = len(stack)
        stack.append(vertex)
    pieces.append(stack)
    out = []
    for piece in pieces:
        sums = np.zeros(channels)
        for _, _, own in piece:
            if own is not None:
                sums += own
        out.append((_simplify(piece), sums))
    return out


def _join(paths: list[_Path]) -> _Path:
    """Paths in order as one (the longest one's vertex deque extended at both ends: linear overall)."""
    if len(paths) == 1:
        return paths[0]
    base = max(range(len(paths)), key=lambda i: len(paths[i].points))
    points = paths[base].points
    for before in reversed(paths[:base]):
        points.extendleft(reversed(before.points))
    for after in paths[base + 1:]:
        points.extend(after.points)
    total = paths[0].sums.copy()
    for path in paths[1:]:
        total += path.sums
    return _Path(paths[0].start, paths[-1].end, paths[0].first, paths[-1].last, points, total)


def _simplify(points: list[Vertex]) -> np.ndarray:
    """The ring's corner vertices only (runs continuing straight across strips merged), closed."""
    ring = np.array([(x, y) for x, y, _ in points], dtype=np.float64)
    before, after = np.roll(ring, 1, axis=0), np.roll(ring, -1, axis=0)
    incoming, outgoing = ring - before, after - ring
    turn = incoming[:, 0] * outgoing[:, 1] - incoming[:, 1] * outgoing[:, 0]
    corners = ring[turn != 0]
    return np.vstack([corners, corners[:1]])


def _contains(ring: np.ndarray, points: np.ndarray, chunk: int = 1 << 22) -> np.ndarray:
    """Which ``points`` (never on an edge: half-integer) lie inside the closed axis-parallel ring (crossing count)."""
    vertical = ring[:-1, 0] == ring[1:, 0]
    ex, ya, yb = ring[:-1, 0][vertical], ring[:-1, 1][vertical], ring[1:, 1][vertical]
    low, high = np.minimum(ya, yb), np.maximum(ya, yb)
    out = np.empty(len(points), dtype=bool)
    step = max(1, chunk // max(1, ex.size))
    for start in range(0, len(points), step):
        px, py = points[start:start + step, :1], points[start:start + step, 1:]
        crossings = (low[None] < py) & (py < high[None]) & (ex[None] > px)
        out[start:start + step] = crossings.sum(axis=1) % 2 == 1
    return out
