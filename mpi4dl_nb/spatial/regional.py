"""A conv/pool after a halo exchange computed by regions (spatial/region.py), without the extended tile.

The interior runs on the owned tile (natively padded, so no copy when the plan is aligned),
while the first phase's messages fly when overlap is on; each boundary band runs on a small box of the
extended tile assembled from the tile's edge, the strips and the padding value. Every output
reads the same window values as on the extended tile, so the result equals the extended
path's; backward is the exact adjoint (box gradients scattered back to the tile and the
strips, strips' gradients returned to their owners). What backward keeps: a conv the tile and the strips;
a pool whose gradient needs no input values (``RegionOp.reads_input`` False) only what ``run_saving`` kept
(max pooling: its argmax, interior and bands; average pooling: nothing but sizes).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Protocol

import torch

from .backward_half import input_gradient_wanted
from .function_ctx import FunctionContext
from .geometry import AxisExchange
from .halo import HaloExchange, Strips
from .halo_blocks import Block, Index, at, fill_blocks, scatter_blocks
from .region import Extent, RegionPlan, Source, region_plan, segments

Params = Sequence[torch.Tensor | None]
Grads = list[torch.Tensor | None]
Padding = tuple[int, ...]   # symmetric native padding per tiled axis


class RegionOp(Protocol):
    """A windowed op (conv or pool) applied to pieces of its extended input, over the grid's tiled axes."""

    spans: tuple[int, ...]
    strides: tuple[int, ...]
    pad_caps: tuple[int | None, ...]
    reads_input: bool      # whether ``grads`` reads the piece's values (a conv) or only its shape (pools)

    def run(self, piece: torch.Tensor, params: Params, padding: Padding) -> torch.Tensor:
        """The op on ``piece`` with symmetric native ``padding`` (zeros, -inf for max pooling)."""
        ...

    def run_saving(self, piece: torch.Tensor, params: Params, padding: Padding
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``run``, and what ``grads`` needs besides the piece (max pooling: the argmax)."""
        ...

    def grads(self, grad: torch.Tensor, piece: torch.Tensor, params: Params, padding: Padding,
              mask: list[bool], saved: torch.Tensor | None = None) -> tuple[torch.Tensor | None, Grads]:
        """Gradients of ``run`` w.r.t. the piece (if ``mask[0]``) and the params (``mask[1:]``);
        ``saved``: what ``run_saving`` returned for this piece."""
        ...


@lru_cache(maxsize=256)
def cached_region_plan(axes: tuple[AxisExchange, ...], spans: tuple[int, ...], strides: tuple[int, ...],
                       pad_caps: tuple[int | None, ...]) -> RegionPlan | None:
    """``region_plan``, memoised (plans are pure functions of the exchange and the window)."""
    return region_plan(axes, spans, strides, pad_caps)


def plan_for(op: RegionOp, exchange: HaloExchange) -> RegionPlan | None:
    """The region plan of ``op`` on ``exchange`` (None: use the extended tile)."""
    return cached_region_plan(exchange.axes, op.spans, op.strides, op.pad_caps)


def _axis_parts(plan: AxisExchange, lo: int, hi: int) -> list[tuple[slice, Source, int, int]]:
    """The stretches of ``[lo, hi)`` (extended-tile positions) along one axis: (in the box, source, start, stop)."""
    found = []
    for a, b, source in segments(plan):
        start, stop = max(a, lo), min(b, hi)
        if stop > start:
            found.append((slice(start - lo, stop - lo), source, start, stop))
    return found


def _origin(axes: Sequence[AxisExchange], parts: Sequence[tuple[slice, Source, int, int]], last: int | None
            ) -> tuple[slice, ...]:
    """Where a block lies in its source: the owned tile (``last`` None) or the strip of phase ``last``."""
    spans = []
    for k, (plan, (_, _, start, stop)) in enumerate(zip(axes, parts)):
        if last is not None and k < last:          # a strip spans the needed range of the earlier axes
            spans.append(slice(start, stop))
        elif k == last:                            # ... its own range along its axis
            first = plan.offset(plan.recv_prev[0] if parts[k][1] is Source.PREV else plan.recv_next[0])
            spans.append(slice(start - first, stop - first))
        else:                                      # ... and the owned range of the later axes
            shift = plan.needed[0] - plan.owned[0]
            spans.append(slice(start + shift, stop + shift))
    return tuple(spans)


@lru_cache(maxsize=1024)
def box_blocks(axes: tuple[AxisExchange, ...], box: Extent) -> tuple[Block, ...]:
    """The box of the extended tile (``box``: extended-tile positions per axis) as blocks of the tile, the
    strips and padding (``halo_blocks.fill_blocks`` lays them; sources ``[tile, strip 0, strip 1, ...]``)."""
    found = []
    for parts in itertools.product(*(_axis_parts(plan, lo, hi) for plan, (lo, hi) in zip(axes, box))):
        target = tuple(part[0] for part in parts)
        sources = [part[1] for part in parts]
        if Source.PAD in sources:
            found.append(Block(target, None, ()))
            continue
        last = max((k for k, source in enumerate(sources) if source is not Source.OWN), default=None)
        index = 0 if last is None else 1 + 2 * last + (0 if sources[last] is Source.PREV else 1)
        found.append(Block(target, index, _origin(axes, parts, last)))
    return tuple(found)


def gather_box(exchange: HaloExchange, x: torch.Tensor, strips: Strips, box: Extent) -> torch.Tensor:
    """``box`` of the extended tile, assembled from the tile, the strips and the padding value."""
    piece = x.new_empty((*x.shape[:-len(box)], *[hi - lo for lo, hi in box]))
    return fill_blocks(piece, box_blocks(exchange.axes, box), [x, *strips], exchange.pad_value)


def scatter_box(exchange: HaloExchange, grad: torch.Tensor, box: Extent, targets: Grads) -> None:
    """Adjoint of ``gather_box``: add ``grad`` of the box into ``targets`` (tile, strips)."""
    scatter_blocks(grad, box_blocks(exchange.axes, box), targets)


def _out(extent: Extent) -> Index:
    return at(tuple(slice(lo, hi) for lo, hi in extent))


def _native_input(x: torch.Tensor, plan: RegionPlan) -> torch.Tensor:
    return x[at(tuple(slice(axis.start, None) for axis in plan.axes))]


def _native_extent(plan: RegionPlan) -> Extent:
    """The interior in the native run's output coordinates."""
    return tuple((lo - axis.first, hi - axis.first) for axis, (lo, hi) in zip(plan.axes, plan.interior))


def shaped(like: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A stand-in of ``shape`` (``like``'s dtype and device, no memory: one element expanded) for a pool's
    gradient kernel, which reads only its input's shape."""
    return like.new_empty(()).expand(*shape)


class _RegionCtx(FunctionContext, Protocol):
    op: RegionOp
    exchange: HaloExchange
    plan: RegionPlan
    present: list[bool]   # which strips were received (and kept, when the op reads its input)
    params: list[bool]    # which params were given
    kept: list[bool]      # which of [interior, band 0, band 1, ...] ``run_saving`` kept something for
    tile_shape: torch.Size


class _RegionWindowed(torch.autograd.Function):
    """``op`` on the extended tile of ``exchange``, by regions (see module doc)."""

    @staticmethod
    def forward(fctx: _RegionCtx, x: torch.Tensor, op: RegionOp, exchange: HaloExchange, plan: RegionPlan,
                overlap: bool, *params: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous()
        native_pad = tuple(axis.pad for axis in plan.axes)

        def interior() -> tuple[torch.Tensor, torch.Tensor | None]:   # needs no strip: runs while the
            return op.run_saving(_native_input(x, plan), params, native_pad)   # first messages fly

        if overlap:
            strips, (native, kept) = exchange.exchange_strips_overlapped(x, interior)
        else:
            strips = exchange.exchange_strips(x)
            native, kept = interior()
        n = len(plan.axes)
        if plan.aligned:
            out = native
        else:   # the one output-sized temporary: the interior cropped into the output
            out = native.new_empty((*native.shape[:-n], *[axis.out for axis in plan.axes]))
            out[_out(plan.interior)] = native[_out(_native_extent(plan))]
            del native
        saved = [kept]
        for out_box, box in plan.bands:
            out[_out(out_box)], band_kept = op.run_saving(gather_box(exchange, x, strips, box), params, (0,) * n)
            saved.append(band_kept)
        fctx.op, fctx.exchange, fctx.plan, fctx.tile_shape = op, exchange, plan, x.shape
        fctx.present = [s is not None for s in strips]
        fctx.params = [p is not None for p in params]
        fctx.kept = [s is not None for s in saved]
        inputs = [x, *[s for s in strips if s is not None]] if op.reads_input else []
        fctx.save_for_backward(*[p for p in params if p is not None], *[s for s in saved if s is not None], *inputs)
        return out

    @staticmethod
    def backward(fctx: _RegionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        op, exchange, plan = fctx.op, fctx.exchange, fctx.plan
        found = iter(fctx.saved_tensors)
        params = [next(found) if present else None for present in fctx.params]
        saved = [next(found) if kept else None for kept in fctx.kept]
        x, strips = _inputs_back(fctx, found, grad)
        mask = [input_gradient_wanted(fctx.needs_input_grad[0])] + [fctx.needs_input_grad[5 + i]
                                                                     for i in range(len(params))]
        grad = grad.contiguous()
        grad_in, param_grads = op.grads(_native_grad(grad, plan), _native_input(x, plan), params,
                                        tuple(axis.pad for axis in plan.axes), mask, saved[0])
        grad_x = None
        if mask[0]:
            assert grad_in is not None   # asked for by mask[0]
            grad_x = _padded_back(grad_in, x, plan)
        targets: Grads = [grad_x, *(exchange.strip_gradients(x) if mask[0] else [None] * len(strips))]
        for (out_box, box), band_kept in zip(plan.bands, saved[1:]):
            piece = gather_box(exchange, x, strips, box) if op.reads_input else \
                shaped(grad, (*grad.shape[:-len(box)], *[hi - lo for lo, hi in box]))
            grad_piece, band_grads = op.grads(grad[_out(out_box)].contiguous(), piece, params,
                                              (0,) * len(box), mask, band_kept)
            for i, (g, total) in enumerate(zip(band_grads, param_grads)):
                if g is not None:
                    param_grads[i] = g if total is None else total + g
            if grad_piece is not None:
                scatter_box(exchange, grad_piece, box, targets)
        if grad_x is not None:   # mask[0]
            grad_x = exchange.return_gradients(grad_x, targets[1:])
        return (grad_x, None, None, None, None, *[g if m else None for g, m in zip(param_grads, mask[1:])])


def _inputs_back(fctx: _RegionCtx, found: Iterator[torch.Tensor], grad: torch.Tensor) -> tuple[torch.Tensor, Strips]:
    """The tile and the strips forward kept; for an op that reads only shapes, a tile-shaped stand-in and Nones."""
    if not fctx.op.reads_input:
        return shaped(grad, fctx.tile_shape), [None] * len(fctx.present)
    x = next(found)
    return x, [next(found) if present else None for present in fctx.present]


def _native_grad(grad: torch.Tensor, plan: RegionPlan) -> torch.Tensor:
    """The output gradient as the native run saw it: the interior's, zeros where the bands replaced its outputs."""
    if plan.aligned:   # the native run's band outputs were replaced: no gradient through them
        grad_native = grad.clone()
        for out_box, _ in plan.bands:
            grad_native[_out(out_box)] = 0
        return grad_native
    n = len(plan.axes)
    grad_native = grad.new_zeros((*grad.shape[:-n], *[axis.native for axis in plan.axes]))
    grad_native[_out(_native_extent(plan))] = grad[_out(plan.interior)]
    return grad_native


def _padded_back(grad_in: torch.Tensor, x: torch.Tensor, plan: RegionPlan) -> torch.Tensor:
    """The native input's gradient placed in the tile's (zeros before the native run's start)."""
    if not any(axis.start for axis in plan.axes):
        return grad_in
    grad_x = grad_in.new_zeros(x.shape)
    grad_x[at(tuple(slice(axis.start, None) for axis in plan.axes))] = grad_in
    return grad_x


def windowed_by_regions(x: torch.Tensor, op: RegionOp, exchange: HaloExchange, plan: RegionPlan,
                        overlap: bool, params: Params = ()) -> torch.Tensor:
    """``op`` on the extended tile of ``exchange`` computed by regions (memory-lean autograd)."""
    return _RegionWindowed.apply(x, op, exchange, plan, overlap, *params)
