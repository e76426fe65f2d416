"""SpatialConv2d: nn.Conv2d on a tile, its halo exchanged first (any kernel, stride, dilation, groups)."""

from __future__ import annotations

from enum import Enum
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError
from .backward_half import input_gradient_wanted
from .function_ctx import FunctionContext
from .geometry import LayerHalo, Window1d
from .halo import HaloExchange, Strips
from .layer import SpatialLayer, SpatialRuntime, adopt
from .regional import Params, plan_for, windowed_by_regions


def conv_axis_windows(conv: nn.Conv2d | nn.Conv3d) -> tuple[Window1d, ...]:
    """The window of a Conv2d/Conv3d along each of its spatial axes (explicit, 'valid' or 'same' padding)."""
    if conv.padding_mode != "zeros":
        raise ConfigError("model", f"{type(conv).__name__} padding_mode={conv.padding_mode!r} is not "
                          f"supported by spatial parallelism; use padding_mode='zeros'")
    windows = []
    for axis in range(len(conv.kernel_size)):
        k, s, d = conv.kernel_size[axis], conv.stride[axis], conv.dilation[axis]
        if isinstance(conv.padding, str):
            total = d * (k - 1) if conv.padding == "same" else 0
            before, after = total // 2, total - total // 2
        else:
            before = after = conv.padding[axis]
        windows.append(Window1d(k, s, d, before, after))
    return tuple(windows)


def conv_windows(conv: nn.Conv2d) -> tuple[Window1d, Window1d]:
    """Row and column windows of a Conv2d (explicit, 'valid' or 'same' padding)."""
    rows, cols = conv_axis_windows(conv)
    return rows, cols


class SpatialConv2d(SpatialLayer, nn.Conv2d):
    """Conv2d on this rank's tile: exchange the halo (zero padding at image borders), then
    convolve without padding; the result is exactly the owned output range."""

    windows: tuple[Window1d, Window1d]

    @classmethod
    def from_module(cls, conv: nn.Conv2d, runtime: SpatialRuntime, name: str = "") -> SpatialConv2d:
        new = adopt(cls, conv, runtime, name)
        new.windows = conv_windows(conv)
        return new

    def geometry(self, height: int, width: int) -> LayerHalo:
        rows, cols = self.windows
        return LayerHalo.for_windows(self.runtime.grid, height, width, rows, cols, self.layer_name)

    pad_value = 0.0

    def apply_padded(self, y: torch.Tensor, inside: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        """The convolution on an input that already holds its halo and padding."""
        return F.conv2d(y, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        size = self.runtime.input_size(self, x)
        exchange = self._halo(size, lambda: self.runtime.exchange(self.geometry(*size), 0.0))
        return conv_after_exchange(self, x, exchange)


class _HaloConvCtx(FunctionContext, Protocol):
    conv: SpatialConv2d
    exchange: HaloExchange
    present: list[bool]             # which of the four strips were received
    has_bias: bool
    pads: tuple[int, int]           # _BandedHaloConv2d: the per-axis halo


def _save_halo_conv(fctx: _HaloConvCtx, conv: SpatialConv2d, exchange: HaloExchange, x: torch.Tensor,
                    weight: torch.Tensor, bias: torch.Tensor | None, strips: Strips) -> None:
    """Keep what a halo conv's backward needs: the owned tile, the weight, the strips."""
    fctx.conv, fctx.exchange = conv, exchange
    fctx.present = [s is not None for s in strips]
    fctx.has_bias = bias is not None
    fctx.save_for_backward(x, weight, *[s for s in strips if s is not None])


def _load_halo_conv(fctx: _HaloConvCtx) -> tuple[torch.Tensor, torch.Tensor, Strips, list[bool]]:
    """(owned tile, weight, strips, [needs grad of x, weight, bias]) saved by ``_save_halo_conv``."""
    x, weight, *saved = fctx.saved_tensors
    found = iter(saved)
    strips = [next(found) if present else None for present in fctx.present]
    mask = [input_gradient_wanted(fctx.needs_input_grad[0]), fctx.needs_input_grad[1],
            fctx.has_bias and fctx.needs_input_grad[2]]
    return x, weight, strips, mask


class _HaloConv2d(torch.autograd.Function):
    """Halo exchange + convolution that saves only the owned tile and the received strips
    (not the extended tile, which would double activation memory next to the previous
    layer's saved output); backward rebuilds the extended tile without messages."""

    @staticmethod
    def forward(fctx: _HaloConvCtx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv: SpatialConv2d, exchange: HaloExchange) -> torch.Tensor:
        extended, strips = exchange.extend(x)
        out = F.conv2d(extended, weight, bias, conv.stride, 0, conv.dilation, conv.groups)
        _save_halo_conv(fctx, conv, exchange, x, weight, bias, strips)
        return out

    @staticmethod
    def backward(fctx: _HaloConvCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, strips, mask = _load_halo_conv(fctx)
        extended = fctx.exchange.rebuild(x, strips)
        conv = fctx.conv
        grad_ext, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad.contiguous(), extended, weight, [weight.shape[0]] if fctx.has_bias else None,
            list(conv.stride), [0, 0], list(conv.dilation), False, [0, 0], conv.groups, mask)
        del extended
        grad_x = fctx.exchange.backward_tensor(grad_ext) if mask[0] else None
        return grad_x, grad_w if mask[1] else None, grad_b if mask[2] else None, None, None


def band_paddings(conv: SpatialConv2d, exchange: HaloExchange) -> tuple[int, int] | None:
    """Per-axis halo ``(p_rows, p_cols)`` when ``exchange`` widens the owned tile by exactly
    the conv's own symmetric reach on each side (stride 1, nothing trimmed, tile at least
    2p long), each side being either a received strip or padding; None otherwise."""
    halos = []
    for axis, plan in enumerate((exchange.rows, exchange.cols)):
        p = plan.halo_before
        reach = conv.dilation[axis] * (conv.kernel_size[axis] - 1)
        if (conv.stride[axis] != 1 or p < 0 or plan.halo_after != p or 2 * p != reach
                or plan.keep != plan.owned or plan.owned[1] - plan.owned[0] < 2 * p):
            return None
        for recv, pad in ((plan.recv_prev, plan.pad_before), (plan.recv_next, plan.pad_after)):
            if max(0, recv[1] - recv[0]) + pad != p or (pad and recv[1] > recv[0]):
                return None
        halos.append(p)
    return halos[0], halos[1]


class Edge(Enum):
    """A side of a tile; its value is the index of that side's strip in ``Strips``."""

    TOP = 0
    BOTTOM = 1
    LEFT = 2
    RIGHT = 3

    @property
    def spans_rows(self) -> bool:
        """Whether the side's band is rows (top, bottom) rather than columns (left, right)."""
        return self in (Edge.TOP, Edge.BOTTOM)

    @property
    def trailing(self) -> int:
        """0 for the leading side (top, left), 1 for the trailing one (bottom, right)."""
        return self.value % 2


def _bands(x: torch.Tensor, strips: Strips, pr: int, pc: int) -> list[tuple[Edge, torch.Tensor]]:
    """The halo-only input split into edge bands (corners in the row bands), each just wide
    enough (3p) for the p boundary outputs it changes: (edge, band) for edges with a strip."""
    lead, height, width = x.shape[:-2], x.shape[-2], x.shape[-1]
    left, right = strips[Edge.LEFT.value], strips[Edge.RIGHT.value]
    bands = []
    for edge, rows in ((Edge.TOP, slice(0, pr)), (Edge.BOTTOM, slice(2 * pr, 3 * pr))):
        strip = strips[edge.value]
        if strip is None:
            continue
        band = x.new_zeros((*lead, 3 * pr, width + 2 * pc))
        band[..., rows, pc:pc + width] = strip
        source = slice(0, pr) if edge is Edge.TOP else slice(height + pr, height + 2 * pr)
        if left is not None:
            band[..., rows, 0:pc] = left[..., source, :]
        if right is not None:
            band[..., rows, pc + width:] = right[..., source, :]
        bands.append((edge, band))
    for edge, cols in ((Edge.LEFT, slice(0, pc)), (Edge.RIGHT, slice(2 * pc, 3 * pc))):
        strip = strips[edge.value]
        if strip is not None:
            band = x.new_zeros((*lead, height + 2 * pr, 3 * pc))
            band[..., pr:pr + height, cols] = strip[..., pr:pr + height, :]
            bands.append((edge, band))
    return bands


def _edge(out: torch.Tensor, edge: Edge, pr: int, pc: int) -> torch.Tensor:
    """The boundary outputs of ``out`` that one edge band changes (a view)."""
    if edge is Edge.TOP:
        return out[..., :pr, :]
    if edge is Edge.BOTTOM:
        return out[..., out.shape[-2] - pr:, :]
    if edge is Edge.LEFT:
        return out[..., :, :pc]
    return out[..., :, out.shape[-1] - pc:]


# Halo overlap: banded convs compute the owned tile, region convs/pools their interior, while
# the row halos are in flight. Off by default: on one node the messages are ~1-8% of a forward
# and measured no gain (BENCHMARKS.md §2d); worth switching on where messages take
# longer (networks).
HALO_OVERLAP = False
# Strided/dilated/asymmetric convs and max/avg pools by regions (spatial/regional.py), not on
# a copied extended tile; False forces the extended path (benchmarks and tests compare both).
REGIONS = True


class _BandedHaloConv2d(torch.autograd.Function):
    """Halo conv without assembling the extended tile: by linearity the convolution of the
    extended tile is the conv of the owned tile with native zero padding plus the (bias-free)
    conv of the halo-only input, which only touches the p boundary outputs per edge and is
    computed from thin bands around the received strips. Backward likewise: the main conv's
    input gradient is the owned tile's (plus the neighbours' returns), the bands give the
    strips' gradients (sent back) and the weight-gradient correction."""

    @staticmethod
    def forward(fctx: _HaloConvCtx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv: SpatialConv2d, exchange: HaloExchange, pads: tuple[int, int]) -> torch.Tensor:
        x = x.contiguous()
        pr, pc = pads

        def owned() -> torch.Tensor:   # needs no strip: runs while the row messages fly
            return F.conv2d(x, weight, bias, 1, (pr, pc), conv.dilation, conv.groups)

        if HALO_OVERLAP:
            strips, out = exchange.exchange_strips_overlapped(x, owned)
        else:
            strips = exchange.exchange_strips(x)
            out = owned()
        for edge, band in _bands(x, strips, pr, pc):
            _edge(out, edge, pr, pc).add_(F.conv2d(band, weight, None, 1, 0, conv.dilation,
                                                   conv.groups))
        fctx.pads = pads
        _save_halo_conv(fctx, conv, exchange, x, weight, bias, strips)
        return out

    @staticmethod
    def backward(fctx: _HaloConvCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, strips, mask = _load_halo_conv(fctx)
        conv, exchange, (pr, pc) = fctx.conv, fctx.exchange, fctx.pads
        grad = grad.contiguous()
        grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad, x, weight, [weight.shape[0]] if fctx.has_bias else None, [1, 1], [pr, pc],
            list(conv.dilation), False, [0, 0], conv.groups, mask)
        lead, height, width = x.shape[:-2], x.shape[-2], x.shape[-1]
        col_grads: Strips = [None, None]
        row_grads: Strips = [None, None]
        for side in range(2):
            if strips[Edge.LEFT.value + side] is not None and mask[0]:
                col_grads[side] = x.new_zeros((*lead, height + 2 * pr, pc))
        for edge, band in _bands(x, strips, pr, pc):
            grad_band, grad_wb, _ = torch.ops.aten.convolution_backward(
                _edge(grad, edge, pr, pc).contiguous(), band, weight, None, [1, 1], [0, 0],
                list(conv.dilation), False, [0, 0], conv.groups, [mask[0], mask[1], False])
            if mask[1]:
                grad_w += grad_wb
            if not mask[0]:
                continue
            if edge.spans_rows:
                rows = slice(0, pr) if edge is Edge.TOP else slice(2 * pr, 3 * pr)
                target = slice(0, pr) if edge is Edge.TOP else slice(height + pr, height + 2 * pr)
                row_grads[edge.trailing] = grad_band[..., rows, pc:pc + width].contiguous()
                for col_grad, cols in zip(col_grads, (slice(0, pc), slice(pc + width, width + 2 * pc))):
                    if col_grad is not None:
                        col_grad[..., target, :] = grad_band[..., rows, cols]
            else:
                col_grad = col_grads[edge.trailing]
                assert col_grad is not None   # made above for every column strip received
                cols = slice(0, pc) if edge is Edge.LEFT else slice(2 * pc, 3 * pc)
                col_grad[..., pr:pr + height, :] = grad_band[..., pr:pr + height, cols]
        if mask[0]:
            grad_x = exchange.return_gradients(grad_x, col_grads, row_grads)
        return (grad_x if mask[0] else None, grad_w if mask[1] else None,
                grad_b if mask[2] else None, None, None, None)


class _PaddedConvCtx(FunctionContext, Protocol):
    conv: SpatialConv2d
    pads: tuple[int, int, int, int]   # (left, right, top, bottom)
    has_bias: bool


class _PaddedConv2d(torch.autograd.Function):
    """Constant padding + convolution that saves the unpadded input (re-padded in backward),
    used inside fused halo blocks where intermediate layers pad only at image borders."""

    @staticmethod
    def forward(fctx: _PaddedConvCtx, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv: SpatialConv2d, pads: tuple[int, int, int, int]) -> torch.Tensor:
        fctx.conv, fctx.pads, fctx.has_bias = conv, pads, bias is not None
        fctx.save_for_backward(y, weight)
        return F.conv2d(F.pad(y, pads), weight, bias, conv.stride, 0, conv.dilation, conv.groups)

    @staticmethod
    def backward(fctx: _PaddedConvCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y, weight = fctx.saved_tensors
        conv, (left, right, top, bottom) = fctx.conv, fctx.pads
        mask = [input_gradient_wanted(fctx.needs_input_grad[0]), fctx.needs_input_grad[1],
                fctx.has_bias and fctx.needs_input_grad[2]]
        grad_ext, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad.contiguous(), F.pad(y, fctx.pads), weight,
            [weight.shape[0]] if fctx.has_bias else None, list(conv.stride), [0, 0],
            list(conv.dilation), False, [0, 0], conv.groups, mask)
        grad_y = None
        if mask[0]:
            height, width = grad_ext.shape[-2:]
            grad_y = grad_ext[..., top:height - bottom, left:width - right]
        return grad_y, grad_w if mask[1] else None, grad_b if mask[2] else None, None, None


def autocast_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Under autocast, the conv's operands in the compute dtype (as autocast casts them for
    F.conv2d; differentiable casts), so the halo travels, the tile is saved and backward runs
    in that dtype as in the serial model; unchanged otherwise."""
    dtype = autocast_dtype(x)
    if dtype is None:
        return x, weight, bias
    return x.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None


def autocast_kind(x: torch.Tensor) -> str:
    """The autocast device type of ``x``'s device."""
    return x.device.type if x.device.type in ("cpu", "cuda") else "cpu"


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes an op on ``x`` in (bf16/fp16), None when autocast is off or ``x`` is float64."""
    kind = autocast_kind(x)
    if not torch.is_autocast_enabled(kind) or x.dtype == torch.float64:
        return None
    return torch.get_autocast_dtype(kind)


class ConvPieces:
    """A SpatialConv2d's convolution on pieces of its extended input (a ``RegionOp``)."""

    pad_caps: tuple[int | None, int | None] = (None, None)

    def __init__(self, conv: SpatialConv2d) -> None:
        self.conv = conv
        self.spans = (conv.dilation[0] * (conv.kernel_size[0] - 1) + 1,
                      conv.dilation[1] * (conv.kernel_size[1] - 1) + 1)
        self.strides = (conv.stride[0], conv.stride[1])

    def run(self, piece: torch.Tensor, params: Params, padding: tuple[int, int]) -> torch.Tensor:
        weight, bias = params
        assert weight is not None
        conv = self.conv
        return F.conv2d(piece, weight, bias, conv.stride, padding, conv.dilation, conv.groups)

    def run_saving(self, piece: torch.Tensor, params: Params, padding: tuple[int, int]
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.run(piece, params, padding), None

    def grads(self, grad: torch.Tensor, piece: torch.Tensor, params: Params, padding: tuple[int, int],
              mask: list[bool], saved: torch.Tensor | None = None) -> tuple[torch.Tensor | None, list]:
        weight, bias = params
        assert weight is not None
        conv, has_bias = self.conv, bias is not None
        wanted = [mask[0], mask[1], has_bias and mask[2]]
        grad_in, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad, piece, weight, [weight.shape[0]] if has_bias else None, list(conv.stride),
            list(padding), list(conv.dilation), False, [0, 0], conv.groups, wanted)
        return (grad_in if wanted[0] else None,
                [grad_w if wanted[1] else None, grad_b if wanted[2] else None])


def conv_after_exchange(conv: SpatialConv2d, x: torch.Tensor, exchange: HaloExchange) -> torch.Tensor:
    """``conv`` on the owned tile ``x`` through ``exchange`` (memory-lean autograd)."""
    if exchange.identity:
        return conv.apply_padded(x)
    x, weight, bias = autocast_operands(x, conv.weight, conv.bias)
    pads = band_paddings(conv, exchange)
    if pads is not None:
        return _BandedHaloConv2d.apply(x, weight, bias, conv, exchange, pads)
    if REGIONS:
        op = ConvPieces(conv)
        plan = plan_for(op, exchange)
        if plan is not None:
            return windowed_by_regions(x, op, exchange, plan, HALO_OVERLAP, (weight, bias))
    return _HaloConv2d.apply(x, weight, bias, conv, exchange)


def conv_after_padding(conv: SpatialConv2d, y: torch.Tensor,
                       pads: tuple[int, int, int, int]) -> torch.Tensor:
    """``conv`` on ``y`` zero-padded by ``pads`` (left, right, top, bottom), memory-lean."""
    if not any(pads):
        return conv.apply_padded(y)
    y, weight, bias = autocast_operands(y, conv.weight, conv.bias)
    return _PaddedConv2d.apply(y, weight, bias, conv, pads)
