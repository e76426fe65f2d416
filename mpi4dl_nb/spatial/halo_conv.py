"""A convolution after a halo exchange as autograd Functions that never keep the extended tile for backward.

Extended: the exchange builds the extended tile, the conv runs on it; backward rebuilds it from the owned
tile and the strips, without messages. Banded (a stride-1 conv whose halo is exactly its own reach): by
linearity the convolution of the extended tile is the conv of the owned tile with native zero padding
plus the (bias-free) conv of the halo-only input, which only touches the ``p`` boundary outputs along each
axis and is computed from one thin band per received strip; the owned tile's conv needs no strip and runs
while the first phase's messages fly (overlap). Padded: constant padding + conv inside a fused block,
keeping the unpadded input. Any number of tiled axes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from .backward_half import input_gradient_wanted
from .function_ctx import FunctionContext
from .halo import HaloExchange, Strips
from .halo_blocks import Index, at

Padding = tuple[int, ...]


CONVOLUTIONS: dict[int, Callable[..., torch.Tensor]] = {2: F.conv2d, 3: F.conv3d}   # by tiled axes


class TileConv(Protocol):
    """What a convolution here reads of its conv layer (an ``nn.Conv2d`` / ``nn.Conv3d`` or its spatial class)."""

    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int


def convolve(conv: TileConv, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             padding: Padding | int = 0, stride: tuple[int, ...] | None = None) -> torch.Tensor:
    """``conv``'s convolution (its dilation, groups and, unless given, stride) of ``y`` with ``weight``, ``bias``."""
    convolution = CONVOLUTIONS[len(conv.kernel_size)]
    return convolution(y, weight, bias, conv.stride if stride is None else stride, padding, conv.dilation,
                       conv.groups)


def conv_gradients(conv: TileConv, grad: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, has_bias: bool,
                   padding: Padding, mask: list[bool], stride: tuple[int, ...] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``convolution_backward`` of ``convolve(conv, y, weight, bias, padding, stride)``: input, weight and bias
    gradients (those ``mask`` asks for)."""
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = torch.ops.aten.convolution_backward(
        grad, y, weight, [weight.shape[0]] if has_bias else None, list(conv.stride if stride is None else stride),
        list(padding), list(conv.dilation), False, [0] * len(conv.kernel_size), conv.groups, mask)
    return grads


class _HaloConvCtx(FunctionContext, Protocol):
    conv: TileConv
    exchange: HaloExchange
    present: list[bool]             # which of the strips were received
    has_bias: bool
    pads: Padding                   # the banded conv's per-axis halo; the padded conv's F.pad padding


def _save(fctx: _HaloConvCtx, conv: TileConv, exchange: HaloExchange, x: torch.Tensor, weight: torch.Tensor,
          bias: torch.Tensor | None, strips: Strips) -> None:
    """Keep what a halo conv's backward needs: the owned tile, the weight, the strips."""
    fctx.conv, fctx.exchange = conv, exchange
    fctx.present = [s is not None for s in strips]
    fctx.has_bias = bias is not None
    fctx.save_for_backward(x, weight, *[s for s in strips if s is not None])


def _mask(fctx: _HaloConvCtx) -> list[bool]:
    """[needs grad of the input, the weight, the bias]."""
    return [input_gradient_wanted(fctx.needs_input_grad[0]), fctx.needs_input_grad[1],
            fctx.has_bias and fctx.needs_input_grad[2]]


def _load(fctx: _HaloConvCtx) -> tuple[torch.Tensor, torch.Tensor, Strips]:
    """(owned tile, weight, strips) saved by ``_save``."""
    x, weight, *saved = fctx.saved_tensors
    found = iter(saved)
    return x, weight, [next(found) if present else None for present in fctx.present]


class _ExtendedConv(torch.autograd.Function):
    """Halo exchange + convolution of the extended tile, saving the owned tile and the strips."""

    @staticmethod
    def forward(fctx: _HaloConvCtx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv: TileConv, exchange: HaloExchange) -> torch.Tensor:
        extended, strips = exchange.extend(x)
        out = convolve(conv, extended, weight, bias)
        _save(fctx, conv, exchange, x, weight, bias, strips)
        return out

    @staticmethod
    def backward(fctx: _HaloConvCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, strips = _load(fctx)
        mask = _mask(fctx)
        extended = fctx.exchange.rebuild(x, strips)
        grad_ext, grad_w, grad_b = conv_gradients(fctx.conv, grad.contiguous(), extended, weight, fctx.has_bias,
                                                       (0,) * len(fctx.exchange.axes), mask)
        del extended
        grad_x = fctx.exchange.backward_tensor(grad_ext) if mask[0] else None
        return grad_x, grad_w if mask[1] else None, grad_b if mask[2] else None, None, None


def extended_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv: TileConv,
                  exchange: HaloExchange) -> torch.Tensor:
    out: torch.Tensor = _ExtendedConv.apply(x, weight, bias, conv, exchange)
    return out


def band_paddings(conv: TileConv, exchange: HaloExchange) -> Padding | None:
    """Per-axis halo ``p`` when ``exchange`` widens the owned tile by exactly the conv's own symmetric reach
    on each side (stride 1, nothing trimmed, tile at least 2p long), each side being either a received strip
    or padding; None otherwise."""
    halos = []
    for axis, plan in enumerate(exchange.axes):
        p = plan.halo_before
        reach = conv.dilation[axis] * (conv.kernel_size[axis] - 1)
        if (conv.stride[axis] != 1 or p < 0 or plan.halo_after != p or 2 * p != reach
                or plan.keep != plan.owned or plan.owned[1] - plan.owned[0] < 2 * p):
            return None
        for recv, pad in ((plan.recv_prev, plan.pad_before), (plan.recv_next, plan.pad_after)):
            if max(0, recv[1] - recv[0]) + pad != p or (pad and recv[1] > recv[0]):
                return None
        halos.append(p)
    return tuple(halos)


def _band_slices(k: int, side: int, pads: Padding, owned: tuple[int, ...]) -> tuple[slice, ...]:
    """Where strip ``2k + side`` lies in its band: the band spans the extended range of every axis but
    ``k``, along which it is ``3p`` long (the strip at its start or end); the strip spans the extended range
    of the earlier axes and the owned range of the later ones."""
    spans = [slice(None)] * k + [slice(0, pads[k]) if side == 0 else slice(2 * pads[k], 3 * pads[k])]
    return tuple(spans + [slice(p, p + size) for p, size in zip(pads[k + 1:], owned[k + 1:])])


def _edge(k: int, side: int, pads: Padding, out: torch.Tensor) -> Index:
    """The ``p`` boundary outputs along axis ``k`` on ``side`` that one band changes."""
    n = len(pads)
    length = out.shape[k - n]
    return at((*[slice(None)] * k, slice(0, pads[k]) if side == 0 else slice(length - pads[k], length),
               *[slice(None)] * (n - k - 1)))


def _bands(x: torch.Tensor, strips: Strips, pads: Padding) -> list[tuple[int, int, torch.Tensor]]:
    """The halo-only input split into one band per received strip: (axis, side, band), each just wide enough
    (``3p`` along its axis) for the ``p`` boundary outputs it changes."""
    n = len(pads)
    lead, owned = x.shape[:-n], tuple(x.shape[-n:])
    found = []
    for k in range(n):
        for side in (0, 1):
            strip = strips[2 * k + side]
            if strip is None:
                continue
            shape = [size + 2 * p for size, p in zip(owned, pads)]
            shape[k] = 3 * pads[k]
            band = x.new_zeros((*lead, *shape))
            band[at(_band_slices(k, side, pads, owned))] = strip
            found.append((k, side, band))
    return found


class _BandedConv(torch.autograd.Function):
    """Halo conv without assembling the extended tile (see module doc). Backward likewise: the main conv's
    input gradient is the owned tile's (plus the neighbours' returns), the bands give the strips' gradients
    (sent back) and the weight-gradient correction."""

    @staticmethod
    def forward(fctx: _HaloConvCtx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv: TileConv, exchange: HaloExchange, pads: Padding, overlap: bool) -> torch.Tensor:
        x = x.contiguous()

        def owned() -> torch.Tensor:   # needs no strip: runs while the first messages fly
            return convolve(conv, x, weight, bias, pads, (1,) * len(pads))

        if overlap:
            strips, out = exchange.exchange_strips_overlapped(x, owned)
        else:
            strips = exchange.exchange_strips(x)
            out = owned()
        for k, side, band in _bands(x, strips, pads):
            out[_edge(k, side, pads, out)].add_(convolve(conv, band, weight, None, 0, (1,) * len(pads)))
        fctx.pads = pads
        _save(fctx, conv, exchange, x, weight, bias, strips)
        return out

    @staticmethod
    def backward(fctx: _HaloConvCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, strips = _load(fctx)
        mask = _mask(fctx)
        conv, exchange, pads = fctx.conv, fctx.exchange, fctx.pads
        ones, owned = (1,) * len(pads), tuple(x.shape[-len(pads):])
        grad = grad.contiguous()
        grad_x, grad_w, grad_b = conv_gradients(conv, grad, x, weight, fctx.has_bias, pads, mask, ones)
        strip_grads: Strips = [None] * len(strips)
        for k, side, band in _bands(x, strips, pads):
            grad_band, grad_wb, _ = conv_gradients(conv, grad[_edge(k, side, pads, grad)].contiguous(), band, weight,
                                                   False, (0,) * len(pads), [mask[0], mask[1], False], ones)
            if mask[1]:
                grad_w += grad_wb
            if mask[0]:
                strip_grads[2 * k + side] = grad_band[at(_band_slices(k, side, pads, owned))].contiguous()
        if mask[0]:
            grad_x = exchange.return_gradients(grad_x, strip_grads)
        return (grad_x if mask[0] else None, grad_w if mask[1] else None,
                grad_b if mask[2] else None, None, None, None, None)


def banded_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv: TileConv,
                exchange: HaloExchange, pads: Padding, overlap: bool) -> torch.Tensor:
    out: torch.Tensor = _BandedConv.apply(x, weight, bias, conv, exchange, pads, overlap)
    return out


class _PaddedConv(torch.autograd.Function):
    """Constant padding + convolution that saves the unpadded input (re-padded in backward),
    used inside fused halo blocks where intermediate layers pad only at image borders."""

    @staticmethod
    def forward(fctx: _HaloConvCtx, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv: TileConv, pads: Padding) -> torch.Tensor:
        fctx.conv, fctx.pads, fctx.has_bias = conv, pads, bias is not None
        fctx.save_for_backward(y, weight)
        return convolve(conv, F.pad(y, pads), weight, bias)

    @staticmethod
    def backward(fctx: _HaloConvCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y, weight = fctx.saved_tensors
        mask = _mask(fctx)
        n = len(fctx.pads) // 2
        grad_ext, grad_w, grad_b = conv_gradients(fctx.conv, grad.contiguous(), F.pad(y, fctx.pads), weight,
                                                       fctx.has_bias, (0,) * n, mask)
        grad_y = None
        if mask[0]:
            before_after = list(zip(fctx.pads[::2], fctx.pads[1::2]))[::-1]   # outermost axis first
            grad_y = grad_ext[at(tuple(slice(b, size - a) for (b, a), size
                                       in zip(before_after, grad_ext.shape[-n:])))]
        return grad_y, grad_w if mask[1] else None, grad_b if mask[2] else None, None, None


def padded_conv(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv: TileConv,
                pads: Padding) -> torch.Tensor:
    """``conv`` on ``y`` zero-padded by ``pads`` (``F.pad``'s: before, after per axis, last axis first)."""
    out: torch.Tensor = _PaddedConv.apply(y, weight, bias, conv, pads)
    return out
