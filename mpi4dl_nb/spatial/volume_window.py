"""A volume's windowed layers on its tiles: SpatialConv3d, SpatialMaxPool3d, SpatialAvgPool3d.

Each exchanges its halo along every tiled axis (``AxesHaloExchange``: depth, rows, cols; the
layer's padding value beyond the volume) and applies the torch op without padding, which gives
exactly the tile's owned output range. ``ceil_mode`` is extra padding after the volume
(``pool.ceil_window``); average pooling divides by the serial layer's window counts, computed per
axis from the geometry (``count_include_pad`` both ways, ``divisor_override``). ``apply_padded`` runs each on an
input that already holds its halo and padding (a fused block's, ``spatial/fused.py``).

For backward none keeps the needed tile (which would double the bytes next to the previous layer's saved output):
the conv keeps the owned tile and the received strips and rebuilds the needed tile without messages, the max pool
keeps only its argmax indices, the average pool nothing but sizes.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .backward_half import input_gradient_wanted
from .conv import autocast_operands, conv_axis_windows
from .function_ctx import FunctionContext
from .geometry import AxisExchange, LayerHalo, Window1d
from .halo_axes import AxesHaloExchange
from .layer import SpatialLayer, SpatialRuntime, adopt
from .pool import ceil_window, pool_axis_windows, refuse_indices
from .replay import Strips


class _VolumeWindowed(SpatialLayer):
    """A windowed layer on a volume's tile: one cached ``AxesHaloExchange`` per input size."""

    windows: tuple[Window1d, ...]
    pad_value = 0.0
    ceil_mode = False
    axes_exchanges: dict[tuple[int, ...], AxesHaloExchange]

    def sized_windows(self, sizes: tuple[int, ...]) -> tuple[Window1d, ...]:
        if self.ceil_mode:
            return tuple(ceil_window(w, n) for w, n in zip(self.windows, sizes))
        return self.windows

    def axes_exchange(self, x: torch.Tensor) -> AxesHaloExchange:
        """The exchange of the tile ``x`` (one per input size, cached)."""
        sizes = self.runtime.tiled_sizes(self, x)
        exchange = self.axes_exchanges.get(sizes)
        if exchange is None:
            geometry = LayerHalo.for_axis_windows(self.runtime.grid, sizes, self.sized_windows(sizes),
                                                  self.layer_name)
            exchange = self.axes_exchanges[sizes] = self.runtime.axes_exchange(geometry, self.pad_value)
        return exchange


def _bound(layer: _VolumeWindowed, windows: tuple[Window1d, ...]) -> None:
    object.__setattr__(layer, "windows", windows)
    object.__setattr__(layer, "axes_exchanges", {})


class SpatialConv3d(_VolumeWindowed, nn.Conv3d):
    """Conv3d on a volume's tile (any kernel, stride, dilation, groups; zero padding)."""

    @classmethod
    def from_module(cls, conv: nn.Conv3d, runtime: SpatialRuntime, name: str = "") -> SpatialConv3d:
        new = adopt(cls, conv, runtime, name)
        _bound(new, conv_axis_windows(conv))
        return new

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        x, weight, bias = autocast_operands(x, self.weight, self.bias)
        exchange = self.axes_exchange(x)
        if exchange.identity:
            return F.conv3d(x, weight, bias, self.stride, 0, self.dilation, self.groups)
        out: torch.Tensor = _HaloConv3d.apply(x, weight, bias, self, exchange)
        return out

    def apply_padded(self, y: torch.Tensor, inside: tuple[int, ...] | None = None) -> torch.Tensor:
        """The convolution on an input that already holds its halo and zero padding."""
        y, weight, bias = autocast_operands(y, self.weight, self.bias)
        return F.conv3d(y, weight, bias, self.stride, 0, self.dilation, self.groups)


class _TileCtx(FunctionContext, Protocol):
    exchange: AxesHaloExchange
    present: list[bool]             # which of the six strips were received


def _save_tile(fctx: _TileCtx, exchange: AxesHaloExchange, x: torch.Tensor, strips: Strips,
               *others: torch.Tensor) -> None:
    """Keep the owned tile ``x``, ``others`` and the received strips for a backward that rebuilds the needed tile."""
    fctx.exchange = exchange
    fctx.present = [strip is not None for strip in strips]
    fctx.save_for_backward(x, *others, *[strip for strip in strips if strip is not None])


def _load_tile(fctx: _TileCtx, others: int) -> tuple[torch.Tensor, list[torch.Tensor], Strips]:
    """The owned tile, the ``others`` tensors and the strips ``_save_tile`` kept."""
    x, *saved = fctx.saved_tensors
    found = iter(saved[others:])
    return x, saved[:others], [next(found) if present else None for present in fctx.present]


class _HaloConv3dCtx(_TileCtx, Protocol):
    conv: SpatialConv3d
    has_bias: bool


class _HaloConv3d(torch.autograd.Function):
    """Halo exchange + Conv3d that saves only the owned tile and the received strips, not the needed tile (which
    would double the activation bytes next to the previous layer's saved output, as ``_HaloConv2d`` avoids in
    2-D); backward rebuilds the needed tile without messages."""

    @staticmethod
    def forward(fctx: _HaloConv3dCtx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv: SpatialConv3d, exchange: AxesHaloExchange) -> torch.Tensor:
        needed, strips = exchange.extend(x)
        out = F.conv3d(needed, weight, bias, conv.stride, 0, conv.dilation, conv.groups)
        fctx.conv, fctx.has_bias = conv, bias is not None
        _save_tile(fctx, exchange, x, strips, weight)
        return out

    @staticmethod
    def backward(fctx: _HaloConv3dCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, (weight,), strips = _load_tile(fctx, 1)
        mask = [input_gradient_wanted(fctx.needs_input_grad[0]), fctx.needs_input_grad[1],
                fctx.has_bias and fctx.needs_input_grad[2]]
        needed = fctx.exchange.rebuild(x, strips)
        conv = fctx.conv
        grad_needed, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad.contiguous(), needed, weight, [weight.shape[0]] if fctx.has_bias else None,
            list(conv.stride), [0, 0, 0], list(conv.dilation), False, [0, 0, 0], conv.groups, mask)
        del needed
        grad_x = fctx.exchange.backward_tensor(grad_needed) if mask[0] else None
        return grad_x, grad_w if mask[1] else None, grad_b if mask[2] else None, None, None


class SpatialMaxPool3d(_VolumeWindowed, nn.MaxPool3d):
    """MaxPool3d on a volume's tile: halo exchanged with -inf beyond the volume (as PyTorch pads)."""

    pad_value = float("-inf")

    @classmethod
    def from_module(cls, pool: nn.MaxPool3d, runtime: SpatialRuntime, name: str = "") -> SpatialMaxPool3d:
        refuse_indices(pool, name)
        new = adopt(cls, pool, runtime, name)
        _bound(new, pool_axis_windows(pool, 3, pool.dilation))
        return new

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        exchange = self.axes_exchange(x)
        if exchange.identity:
            return self.apply_padded(x)
        out: torch.Tensor = _HaloMaxPool3d.apply(x, self, exchange)
        return out

    def apply_padded(self, y: torch.Tensor, inside: tuple[int, ...] | None = None) -> torch.Tensor:
        """The pooling on an input that already holds its halo and -inf padding."""
        w = self.windows
        return F.max_pool3d(y, [a.kernel for a in w], [a.stride for a in w], 0, [a.dilation for a in w])


class _HaloPool3dCtx(FunctionContext, Protocol):
    windows: tuple[Window1d, ...]
    exchange: AxesHaloExchange
    needed: torch.Size              # the needed tile's shape (the pool's input in forward)


class _HaloMaxPool3d(torch.autograd.Function):
    """Halo exchange + MaxPool3d that keeps only the argmax indices (as the serial layer, which also keeps its
    input: the needed tile is not kept, nor rebuilt, since a max pool's gradient goes where its indices say)."""

    @staticmethod
    def forward(fctx: _HaloPool3dCtx, x: torch.Tensor, pool: SpatialMaxPool3d,
                exchange: AxesHaloExchange) -> torch.Tensor:
        needed = exchange.forward_tensor(x)
        w = pool.windows
        out, indices = F.max_pool3d(needed, [a.kernel for a in w], [a.stride for a in w], 0,
                                    [a.dilation for a in w], return_indices=True)
        fctx.windows, fctx.exchange, fctx.needed = w, exchange, needed.shape
        fctx.save_for_backward(indices)
        return out

    @staticmethod
    def backward(fctx: _HaloPool3dCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (indices,) = fctx.saved_tensors
        w = fctx.windows
        grad_needed = torch.ops.aten.max_pool3d_with_indices_backward(
            grad.contiguous(), grad.new_empty(fctx.needed), [a.kernel for a in w], [a.stride for a in w],
            [0, 0, 0], [a.dilation for a in w], False, indices)   # the input only gives the gradient's shape
        return fctx.exchange.backward_tensor(grad_needed), None, None


class _HaloAvgSums3d(torch.autograd.Function):
    """Halo exchange + the window sums of AvgPool3d, keeping nothing but sizes (a sum's gradient does not depend on
    its input; the serial layer keeps its input all the same)."""

    @staticmethod
    def forward(fctx: _HaloPool3dCtx, x: torch.Tensor, pool: SpatialAvgPool3d,
                exchange: AxesHaloExchange) -> torch.Tensor:
        needed = exchange.forward_tensor(x)
        w = pool.windows
        fctx.windows, fctx.exchange, fctx.needed = w, exchange, needed.shape
        return F.avg_pool3d(needed, [a.kernel for a in w], [a.stride for a in w], 0, divisor_override=1)

    @staticmethod
    def backward(fctx: _HaloPool3dCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        w = fctx.windows
        grad_needed = torch.ops.aten.avg_pool3d_backward(
            grad.contiguous(), grad.new_empty(fctx.needed), [a.kernel for a in w], [a.stride for a in w],
            [0, 0, 0], False, True, 1)   # the input only gives the gradient's shape
        return fctx.exchange.backward_tensor(grad_needed), None, None


def window_counts(plan: AxisExchange, window: Window1d, out: tuple[int, int], include_pad: bool) -> list[int]:
    """How many positions of each output window along one axis PyTorch's average divides by: the window
    clipped to the padded input (``include_pad``) or to the input itself."""
    size, pad = plan.size, window.pad_before
    low, high = (-pad, size + pad) if include_pad else (0, size)
    counts = []
    for o in range(*out):
        start = o * window.stride - pad
        counts.append(max(0, min(start + window.kernel, high) - max(start, low)))
    return counts


class SpatialAvgPool3d(_VolumeWindowed, nn.AvgPool3d):
    """AvgPool3d on a volume's tile: window sums of the zero-padded needed tile, divided by the serial
    layer's counts."""

    @classmethod
    def from_module(cls, pool: nn.AvgPool3d, runtime: SpatialRuntime, name: str = "") -> SpatialAvgPool3d:
        new = adopt(cls, pool, runtime, name)
        _bound(new, pool_axis_windows(pool, 3))
        return new

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        exchange, w = self.axes_exchange(x), self.windows
        if exchange.identity:
            sums = F.avg_pool3d(x, [a.kernel for a in w], [a.stride for a in w], 0, divisor_override=1)
        else:
            sums = _HaloAvgSums3d.apply(x, self, exchange)
        if self.divisor_override:
            return sums / self.divisor_override
        geometry = exchange.geometry
        outs = geometry.grid.extent(exchange.tile, geometry.out_sizes)
        divisor = torch.ones((), dtype=sums.dtype, device=sums.device)
        for axis, (plan, window, out) in enumerate(zip(geometry.tile(exchange.tile).axes, w, outs)):
            counts = torch.tensor(window_counts(plan, window, out, self.count_include_pad), dtype=sums.dtype,
                                  device=sums.device)
            divisor = divisor * counts.reshape([-1] + [1] * (2 - axis))
        return sums / divisor

    def apply_padded(self, y: torch.Tensor, inside: tuple[int, ...] | None = None) -> torch.Tensor:
        """The pooling on an input that already holds its halo and the serial layer's zero padding (no
        ``ceil_mode`` overhang); ``inside`` (start, stop per axis, local) is the in-volume part the divisor
        counts without ``count_include_pad``, None: every position of the window counts."""
        w = self.windows
        kernel, stride = [a.kernel for a in w], [a.stride for a in w]
        sums = F.avg_pool3d(y, kernel, stride, 0, divisor_override=1)
        if self.divisor_override:
            return sums / self.divisor_override
        if inside is None:
            return sums / math.prod(kernel)
        counted = y.new_zeros((1, 1, *y.shape[-3:]))
        region = counted
        for k in range(3):
            region = region.narrow(2 + k, inside[2 * k], inside[2 * k + 1] - inside[2 * k])
        region.fill_(1)
        return sums / F.avg_pool3d(counted, kernel, stride, 0, divisor_override=1)
