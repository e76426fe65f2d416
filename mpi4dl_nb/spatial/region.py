"""Pure plan of a windowed layer computed by regions: interior from the owned tile, boundary bands from small boxes.

A conv/pool after a halo exchange reads the *extended* tile E (padding, received strips and
the tile's kept rows/columns, see geometry.AxisExchange) with no padding of its own. Output
``o`` along an axis reads E positions ``[o*s, o*s + span)``. Outputs whose window lies
inside the tile's kept part (the *interior*) can be computed straight from the owned tile:
the op runs on the tile (from position ``start``) with a symmetric native ``pad`` so that
its output ``j`` is the layer's output ``first + j``. The other outputs form four bands (top
and bottom over the full width, left and right over the interior rows), each computed from
the small box of E its windows read, assembled from the tile's edge, the strips and the
padding value. No torch, no messages: unit-tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .geometry import AxisExchange, Box, Range


class Source(Enum):
    """Where a stretch of the extended tile comes from along one axis."""

    PAD = "pad"
    PREV = "prev"     # received from the previous tile
    OWN = "own"       # the tile's kept rows/columns
    NEXT = "next"     # received from the next tile


def segments(plan: AxisExchange) -> list[tuple[int, int, Source]]:
    """The extended tile along one axis as ``(start, stop, source)`` stretches (E coordinates)."""
    found = []
    for start, stop, source in ((plan.needed[0], plan.needed[0] + plan.pad_before, Source.PAD),
                                (*plan.recv_prev, Source.PREV),
                                (*plan.keep, Source.OWN),
                                (*plan.recv_next, Source.NEXT),
                                (plan.needed[1] - plan.pad_after, plan.needed[1], Source.PAD)):
        if stop > start:
            found.append((plan.offset(start), plan.offset(stop), source))
    return found


@dataclass(frozen=True)
class AxisRegion:
    """One axis of a region plan.

    ``out``: the layer's output length on this tile; ``first``: the output the native run's
    first output is; ``native``: that run's output length; ``start``/``pad``: the tile
    position it starts from and its symmetric padding; ``interior``: outputs taken from it
    (window inside the kept part, or in native padding standing for the image's padding),
    a non-empty range within ``[first, first + native)``.
    """

    out: int
    first: int
    native: int
    start: int
    pad: int
    interior: Range

    @property
    def aligned(self) -> bool:
        """The native run's outputs are exactly the layer's (no crop, no copy)."""
        return self.first == 0 and self.native == self.out


def plan_region_axis(plan: AxisExchange, span: int, stride: int, pad_cap: int | None = None
                     ) -> AxisRegion | None:
    """Region plan of one axis for a window of ``span`` and ``stride`` applied without padding
    to the extended tile; ``pad_cap`` bounds the native padding the op accepts (pools).
    None when no output can be taken from the tile (tile too small)."""
    out = (plan.needed_len - span) // stride + 1
    before = plan.owned[0] - plan.needed[0]          # halo before (negative: trimmed)
    keep0, keep1 = plan.keep[0] - plan.owned[0], plan.keep[1] - plan.owned[0]   # tile coordinates
    pad = max(0, before) if pad_cap is None else min(max(0, before), pad_cap)
    first = max(0, -(-(before - pad) // stride))      # output j of the native run reads tile
    start = first * stride - before + pad             # positions [start + j*s - pad, ... + span)
    height = plan.owned[1] - plan.owned[0]
    native = (height - start + 2 * pad - span) // stride + 1
    # windows may reach into the native padding where it stands for the image's padding
    # (same value): before the tile when nothing is received or trimmed there, likewise after
    low = -pad if start == 0 and keep0 == 0 and plan.recv_prev[1] <= plan.recv_prev[0] else max(keep0, start)
    high = keep1
    if keep1 == height and plan.recv_next[1] <= plan.recv_next[0]:
        high = height + min(pad, plan.pad_after)
    lo = max(first, -(-(low + before) // stride))
    hi = min(first + native, out, (high + before - span) // stride + 1)
    if native < 1 or hi <= lo:
        return None
    return AxisRegion(out, first, native, start, pad, (lo, hi))


def _inputs(outputs: Range, span: int, stride: int) -> Range:
    """Extended-tile positions that ``outputs`` read."""
    return (outputs[0] * stride, (outputs[1] - 1) * stride + span)


@dataclass(frozen=True)
class RegionPlan:
    """A windowed layer by regions on one tile: the interior from the owned tile and the bands
    as ``(output box, extended-tile box)`` pairs (half-open ``(r0, r1, c0, c1)``)."""

    rows: AxisRegion
    cols: AxisRegion
    bands: tuple[tuple[Box, Box], ...]

    @property
    def interior(self) -> Box:
        return (*self.rows.interior, *self.cols.interior)

    @property
    def aligned(self) -> bool:
        return self.rows.aligned and self.cols.aligned


def region_plan(rows: AxisExchange, cols: AxisExchange, spans: tuple[int, int],
                strides: tuple[int, int], pad_caps: tuple[int | None, int | None] = (None, None)
                ) -> RegionPlan | None:
    """The region plan of a window (``spans``, ``strides`` per axis) on one tile's exchange,
    or None when the tile has no interior along an axis (the extended path is used)."""
    axes = [plan_region_axis(p, span, stride, cap)
            for p, span, stride, cap in zip((rows, cols), spans, strides, pad_caps)]
    r, c = axes
    if r is None or c is None:
        return None
    (r0, r1), (c0, c1) = r.interior, c.interior
    outs = [(0, r0, 0, c.out), (r1, r.out, 0, c.out), (r0, r1, 0, c0), (r0, r1, c1, c.out)]
    bands = []
    for box in outs:
        if box[1] > box[0] and box[3] > box[2]:
            bands.append((box, (*_inputs(box[:2], spans[0], strides[0]),
                                *_inputs(box[2:], spans[1], strides[1]))))
    return RegionPlan(r, c, tuple(bands))
