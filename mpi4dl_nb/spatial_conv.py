"""SpatialConv2d: nn.Conv2d on a tile, its halo exchanged first (any kernel, stride, dilation, groups)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError
from .geometry import LayerHalo, Window1d
from .halo import HaloExchange
from .spatial_base import SpatialLayer, SpatialRuntime, adopt


def conv_windows(conv: nn.Conv2d) -> tuple[Window1d, Window1d]:
    """Row and column windows of a Conv2d (explicit, 'valid' or 'same' padding)."""
    if conv.padding_mode != "zeros":
        raise ConfigError("model", f"Conv2d padding_mode={conv.padding_mode!r} is not supported "
                          f"by spatial parallelism; use padding_mode='zeros'")
    windows = []
    for axis in range(2):
        k, s, d = conv.kernel_size[axis], conv.stride[axis], conv.dilation[axis]
        if isinstance(conv.padding, str):
            total = d * (k - 1) if conv.padding == "same" else 0
            before, after = total // 2, total - total // 2
        else:
            before = after = conv.padding[axis]
        windows.append(Window1d(k, s, d, before, after))
    return windows[0], windows[1]


class SpatialConv2d(SpatialLayer, nn.Conv2d):
    """Conv2d on this rank's tile: exchange the halo (zero padding at image borders), then
    convolve without padding; the result is exactly the owned output range."""

    @classmethod
    def from_module(cls, conv: nn.Conv2d, runtime: SpatialRuntime, name: str = "") -> "SpatialConv2d":
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = self.runtime.input_size(self, x)
        exchange = self._halo(size, lambda: self.runtime.exchange(self.geometry(*size), 0.0))
        return conv_after_exchange(self, x, exchange)


class _HaloConv2d(torch.autograd.Function):
    """Halo exchange + convolution that saves only the owned tile and the received strips
    (not the extended tile, which would double activation memory next to the previous
    layer's saved output); backward rebuilds the extended tile without messages."""

    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv: SpatialConv2d, exchange: HaloExchange) -> torch.Tensor:
        extended, strips = exchange.extend(x)
        out = F.conv2d(extended, weight, bias, conv.stride, 0, conv.dilation, conv.groups)
        fctx.conv, fctx.exchange = conv, exchange
        fctx.present = [s is not None for s in strips]
        fctx.has_bias = bias is not None
        fctx.save_for_backward(x, weight, *[s for s in strips if s is not None])
        return out

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight, *saved = fctx.saved_tensors
        found = iter(saved)
        strips = [next(found) if present else None for present in fctx.present]
        extended = fctx.exchange.rebuild(x, strips)
        conv = fctx.conv
        mask = [fctx.needs_input_grad[0], fctx.needs_input_grad[1],
                fctx.has_bias and fctx.needs_input_grad[2]]
        grad_ext, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad.contiguous(), extended, weight, [weight.shape[0]] if fctx.has_bias else None,
            list(conv.stride), [0, 0], list(conv.dilation), False, [0, 0], conv.groups, mask)
        del extended
        grad_x = fctx.exchange.backward_tensor(grad_ext) if mask[0] else None
        return grad_x, grad_w if mask[1] else None, grad_b if mask[2] else None, None, None


class _PaddedConv2d(torch.autograd.Function):
    """Constant padding + convolution that saves the unpadded input (re-padded in backward),
    used inside fused halo blocks where intermediate layers pad only at image borders."""

    @staticmethod
    def forward(fctx: Any, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv: SpatialConv2d, pads: tuple[int, int, int, int]) -> torch.Tensor:
        fctx.conv, fctx.pads, fctx.has_bias = conv, pads, bias is not None
        fctx.save_for_backward(y, weight)
        return F.conv2d(F.pad(y, pads), weight, bias, conv.stride, 0, conv.dilation, conv.groups)

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        y, weight = fctx.saved_tensors
        conv, (left, right, top, bottom) = fctx.conv, fctx.pads
        mask = [fctx.needs_input_grad[0], fctx.needs_input_grad[1],
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


def conv_after_exchange(conv: SpatialConv2d, x: torch.Tensor, exchange: HaloExchange) -> torch.Tensor:
    """``conv`` on the owned tile ``x`` through ``exchange`` (memory-lean autograd)."""
    if exchange.identity:
        return conv.apply_padded(x)
    return _HaloConv2d.apply(x, conv.weight, conv.bias, conv, exchange)


def conv_after_padding(conv: SpatialConv2d, y: torch.Tensor,
                       pads: tuple[int, int, int, int]) -> torch.Tensor:
    """``conv`` on ``y`` zero-padded by ``pads`` (left, right, top, bottom), memory-lean."""
    if not any(pads):
        return conv.apply_padded(y)
    return _PaddedConv2d.apply(y, conv.weight, conv.bias, conv, pads)
