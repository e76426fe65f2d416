"""A conv/pool after a halo exchange computed by regions (spatial/region.py), without the extended tile.

The interior runs on the owned tile (natively padded, so no copy when the plan is aligned),
while the row messages fly when overlap is on; each boundary band runs on a small box of the
extended tile assembled from the tile's edge, the strips and the padding value. Every output
reads the same window values as on the extended tile, so the result equals the extended
path's; backward is the exact adjoint (box gradients scattered back to the tile and the
strips, strips' gradients returned to their owners), saving only the tile and the strips.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Protocol

import torch

from .backward_half import input_gradient_wanted
from .function_ctx import FunctionContext
from .geometry import AxisExchange, Box
from .halo import HaloExchange, Strips
from .region import RegionPlan, Source, region_plan, segments

Params = Sequence[torch.Tensor | None]
Grads = list[torch.Tensor | None]


class RegionOp(Protocol):
    """A windowed op (conv or pool) applied to pieces of its extended input."""

    spans: tuple[int, int]
    strides: tuple[int, int]
    pad_caps: tuple[int | None, int | None]

    def run(self, piece: torch.Tensor, params: Params, padding: tuple[int, int]) -> torch.Tensor:
        """The op on ``piece`` with symmetric native ``padding`` (zeros, -inf for max pooling)."""
        ...

    def run_saving(self, piece: torch.Tensor, params: Params, padding: tuple[int, int]
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``run``, and what ``grads`` needs besides the piece (max pooling: the argmax)."""
        ...

    def grads(self, grad: torch.Tensor, piece: torch.Tensor, params: Params, padding: tuple[int, int],
              mask: list[bool], saved: torch.Tensor | None = None) -> tuple[torch.Tensor | None, Grads]:
        """Gradients of ``run`` w.r.t. the piece (if ``mask[0]``) and the params (``mask[1:]``);
        ``saved``: what ``run_saving`` returned for this piece, if it was kept."""
        ...


@lru_cache(maxsize=256)
def cached_region_plan(rows: AxisExchange, cols: AxisExchange, spans: tuple[int, int],
                       strides: tuple[int, int], pad_caps: tuple[int | None, int | None]
                       ) -> RegionPlan | None:
    """``region_plan``, memoised (plans are pure functions of the exchange and the window)."""
    return region_plan(rows, cols, spans, strides, pad_caps)


def plan_for(op: RegionOp, exchange: HaloExchange) -> RegionPlan | None:
    """The region plan of ``op`` on ``exchange`` (None: use the extended tile)."""
    return cached_region_plan(exchange.rows, exchange.cols, op.spans, op.strides, op.pad_caps)


def _blocks(exchange: HaloExchange, box: Box) -> Iterator[tuple[slice, slice, int | None, slice, slice]]:
    """The box of the extended tile as blocks: (rows, cols in the box, source index into
    ``[tile, strip 0..3]`` or None for padding, rows, cols in that source)."""
    rows, cols = exchange.rows, exchange.cols
    r_shift, c_shift = rows.needed[0] - rows.owned[0], cols.needed[0] - cols.owned[0]
    for a, b, r_src in segments(rows):
        r0, r1 = max(a, box[0]), min(b, box[1])
        if r1 <= r0:
            continue
        for c, d, c_src in segments(cols):
            c0, c1 = max(c, box[2]), min(d, box[3])
            if c1 <= c0:
                continue
            here = (slice(r0 - box[0], r1 - box[0]), slice(c0 - box[2], c1 - box[2]))
            own_cols = slice(c0 + c_shift, c1 + c_shift)
            if Source.PAD in (r_src, c_src):
                yield (*here, None, slice(0), slice(0))
            elif c_src is not Source.OWN:      # column strips span the whole needed row range
                yield (*here, 3 if c_src is Source.PREV else 4, slice(r0, r1), slice(c0 - c, c1 - c))
            elif r_src is not Source.OWN:      # row strips span the owned columns
                yield (*here, 1 if r_src is Source.PREV else 2, slice(r0 - a, r1 - a), own_cols)
            else:
                yield (*here, 0, slice(r0 + r_shift, r1 + r_shift), own_cols)


def gather_box(exchange: HaloExchange, x: torch.Tensor, strips: Strips, box: Box) -> torch.Tensor:
    """``box`` of the extended tile, assembled from the tile, the strips and the padding value."""
    sources = [x, *strips]
    piece = x.new_empty((*x.shape[:-2], box[1] - box[0], box[3] - box[2]))
    for rows, cols, source, src_rows, src_cols in _blocks(exchange, box):
        if source is None:
            piece[..., rows, cols] = exchange.pad_value
        else:
            held = sources[source]
            assert held is not None   # the plan reads only strips that were received
            piece[..., rows, cols] = held[..., src_rows, src_cols]
    return piece


def scatter_box(exchange: HaloExchange, grad: torch.Tensor, box: Box, targets: Grads) -> None:
    """Adjoint of ``gather_box``: add ``grad`` of the box into ``targets`` (tile, strips 0..3)."""
    for rows, cols, source, src_rows, src_cols in _blocks(exchange, box):
        if source is not None:
            target = targets[source]
            assert target is not None   # a gradient buffer for every source the plan reads
            target[..., src_rows, src_cols] += grad[..., rows, cols]


def _out(box: Box) -> tuple[slice, slice]:
    return slice(box[0], box[1]), slice(box[2], box[3])


def _native_input(x: torch.Tensor, plan: RegionPlan) -> torch.Tensor:
    return x[..., plan.rows.start:, plan.cols.start:]


def _native_box(plan: RegionPlan) -> Box:
    """The interior in the native run's output coordinates."""
    (r0, r1), (c0, c1) = plan.rows.interior, plan.cols.interior
    return (r0 - plan.rows.first, r1 - plan.rows.first, c0 - plan.cols.first, c1 - plan.cols.first)


class _RegionCtx(FunctionContext, Protocol):
    op: RegionOp
    exchange: HaloExchange
    plan: RegionPlan
    present: list[bool]   # which strips were received
    params: list[bool]    # which params were given
    kept: bool            # whether ``run_saving`` kept something (max pooling: the argmax)


class _RegionWindowed(torch.autograd.Function):
    """``op`` on the extended tile of ``exchange``, by regions (see module doc)."""

    @staticmethod
    def forward(fctx: _RegionCtx, x: torch.Tensor, op: RegionOp, exchange: HaloExchange, plan: RegionPlan,
                overlap: bool, *params: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous()
        native_pad = (plan.rows.pad, plan.cols.pad)

        def interior() -> tuple[torch.Tensor, torch.Tensor | None]:   # needs no strip: runs while
            return op.run_saving(_native_input(x, plan), params, native_pad)   # the row messages fly

        if overlap:
            strips, (native, kept) = exchange.exchange_strips_overlapped(x, interior)
        else:
            strips = exchange.exchange_strips(x)
            native, kept = interior()
        if plan.aligned:
            out = native
        else:   # the one output-sized temporary: the interior cropped into the output
            out = native.new_empty((*native.shape[:-2], plan.rows.out, plan.cols.out))
            out[(..., *_out(plan.interior))] = native[(..., *_out(_native_box(plan)))]
            del native
        for out_box, box in plan.bands:
            out[(..., *_out(out_box))] = op.run(gather_box(exchange, x, strips, box), params, (0, 0))
        fctx.op, fctx.exchange, fctx.plan = op, exchange, plan
        fctx.present = [s is not None for s in strips]
        fctx.params = [p is not None for p in params]
        fctx.kept = kept is not None
        fctx.save_for_backward(x, *[p for p in params if p is not None], *[s for s in strips if s is not None],
                               *([kept] if kept is not None else []))
        return out

    @staticmethod
    def backward(fctx: _RegionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        op, exchange, plan = fctx.op, fctx.exchange, fctx.plan
        x, *saved = fctx.saved_tensors
        found = iter(saved)
        params = [next(found) if present else None for present in fctx.params]
        strips = [next(found) if present else None for present in fctx.present]
        kept = next(found) if fctx.kept else None
        mask = [input_gradient_wanted(fctx.needs_input_grad[0])] + [fctx.needs_input_grad[5 + i]
                                                                     for i in range(len(params))]
        grad = grad.contiguous()
        native_in = _native_input(x, plan)
        if plan.aligned:   # the native run's band outputs were replaced: no gradient through them
            grad_native = grad.clone()
            for out_box, _ in plan.bands:
                grad_native[(..., *_out(out_box))] = 0
        else:
            grad_native = grad.new_zeros((*grad.shape[:-2], plan.rows.native, plan.cols.native))
            grad_native[(..., *_out(_native_box(plan)))] = grad[(..., *_out(plan.interior))]
        grad_in, param_grads = op.grads(grad_native, native_in, params,
                                        (plan.rows.pad, plan.cols.pad), mask, kept)
        del grad_native
        grad_x = None
        if mask[0]:
            assert grad_in is not None   # asked for by mask[0]
            if plan.rows.start or plan.cols.start:
                grad_x = x.new_zeros(x.shape)
                grad_x[..., plan.rows.start:, plan.cols.start:] = grad_in
            else:
                grad_x = grad_in
        targets: Grads = [grad_x] + [None if s is None or not mask[0] else torch.zeros_like(s) for s in strips]
        for out_box, box in plan.bands:
            piece = gather_box(exchange, x, strips, box)
            grad_piece, band_grads = op.grads(grad[(..., *_out(out_box))].contiguous(), piece, params,
                                              (0, 0), mask)
            for i, (g, total) in enumerate(zip(band_grads, param_grads)):
                if g is not None:
                    param_grads[i] = g if total is None else total + g
            if grad_piece is not None:
                scatter_box(exchange, grad_piece, box, targets)
        if grad_x is not None:   # mask[0]
            grad_x = exchange.return_gradients(grad_x, targets[3:5], targets[1:3])
        return (grad_x, None, None, None, None, *[g if m else None for g, m in zip(param_grads, mask[1:])])


def windowed_by_regions(x: torch.Tensor, op: RegionOp, exchange: HaloExchange, plan: RegionPlan,
                        overlap: bool, params: Params = ()) -> torch.Tensor:
    """``op`` on the extended tile of ``exchange`` computed by regions (memory-lean autograd)."""
    return _RegionWindowed.apply(x, op, exchange, plan, overlap, *params)
