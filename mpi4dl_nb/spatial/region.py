"""Pure plan of a windowed layer computed by regions: interior from the owned tile, boundary bands from small boxes.
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from .geometry import AxisExchange, Range


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


Extent = tuple[Range, ...]   # a half-open range per tiled axis


@dataclass(frozen=True)
class RegionPlan:
    """A windowed layer by regions on one tile: the interior from the owned tile and the bands as ``(output
    extent, extended-tile extent)`` pairs (a half-open range per tiled axis)."""

    axes: tuple[AxisRegion, ...]
    bands: tuple[tuple[Extent, Extent], ...]

    @property
    def interior(self) -> Extent:
        return tuple(axis.interior for axis in self.axes)

    @property
    def aligned(self) -> bool:
        return all(axis.aligned for axis in self.axes)


def region_plan(plans: Sequence[AxisExchange], spans: Sequence[int], strides: Sequence[int],
                pad_caps: Sequence[int | None] | None = None) -> RegionPlan | None:
    """The region plan of a window (``spans``, ``strides`` per tiled axis) on one tile's exchange (its plan per
    axis), or None when the tile has no interior along an axis (the extended path is used).

    Bands, per axis ``k`` in turn: the outputs before and after the interior along ``k``, over the interior
    of the earlier axes and every output of the later ones (an image's: top and bottom over the full width,
    then left and right over the interior rows)."""
    caps = pad_caps if pad_caps is not None else (None,) * len(plans)
    axes = [plan_region_axis(p, span, stride, cap) for p, span, stride, cap in zip(plans, spans, strides, caps)]
    if any(axis is None for axis in axes):
        return None
    regions = tuple(axis for axis in axes if axis is not None)
    bands = []
    for k, axis in enumerate(regions):
        for part in ((0, axis.interior[0]), (axis.interior[1], axis.out)):
            out = (*[a.interior for a in regions[:k]], part, *[(0, a.out) for a in regions[k + 1:]])
            if all(hi > lo for lo, hi in out):
                bands.append((out, tuple(_inputs(r, span, stride) for r, span, stride in zip(out, spans, strides))))
    return RegionPlan(regions, tuple(bands))
