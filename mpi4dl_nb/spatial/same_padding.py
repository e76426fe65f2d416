"""timm's TF-"same" padded and weight-standardised layers on tiles: StdConv2d(Same), Conv2dSame, MaxPool2dSame.

Their forward pads the whole image by ``F.pad`` with amounts that depend on its size, then convolves or pools
without padding; on tiles that is a spatial conv/pool whose window pads asymmetrically, by the amounts for the
layer's GLOBAL input size (``sized_windows``). Weight standardisation (``F.batch_norm`` over each filter) acts on
the replicated weight only: the conv runs with the standardised weight, whose gradient flows back to the parameter.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .conv import SpatialConv, conv_after_exchange, conv_axis_windows
from .family import Family, TimmMatch
from .geometry import KernelAxis
from .layer import Convert, SpatialRuntime, adopt
from .pool import SpatialMaxPool


def same_window(window: KernelAxis, size: int) -> KernelAxis:
    """``window`` padded as TF "same" pads an input of ``size`` (timm's ``pad_same``: the odd pixel after)."""
    total = max((math.ceil(size / window.stride) - 1) * window.stride + window.span - size, 0)
    return KernelAxis(window.kernel, window.stride, window.dilation, total // 2, total - total // 2)


class _SamePadded:
    """Mixin of a spatial conv/pool: windows padded for the input's global size when the layer pads dynamically."""

    windows: tuple[KernelAxis, ...]
    pads_dynamically: bool

    def sized_windows(self, sizes: tuple[int, ...]) -> tuple[KernelAxis, ...]:
        if not self.pads_dynamically:
            return self.windows
        return tuple(same_window(window, size) for window, size in zip(self.windows, sizes))


class SpatialStdConv(_SamePadded, SpatialConv):
    """timm's StdConv2d / StdConv2dSame / Conv2dSame on a tile (``standardises``: StdConv's weight standardisation)."""

    standardises: bool
    eps: float

    def standardised_weight(self) -> torch.Tensor:
        current = self.__dict__.get("weight")   # inside tile_forward: already standardised
        if isinstance(current, torch.Tensor):
            return current
        weight = self._parameters["weight"]
        assert weight is not None
        if not self.standardises:
            return weight
        eps = self.eps
        return F.batch_norm(weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.0,
                            eps=eps).reshape_as(weight)

    def apply_padded(self, y: torch.Tensor, inside: tuple[int, ...] | None = None) -> torch.Tensor:
        return F.conv2d(y, self.standardised_weight(), self.bias, self.stride, 0, self.dilation, self.groups)

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        exchange = self.exchange_for(x)
        with _weight_as(self, self.standardised_weight()):
            return conv_after_exchange(self, x, exchange)


class _weight_as:
    """Inside: ``conv.weight`` reads ``weight`` (the halo conv paths read the conv's weight)."""

    def __init__(self, conv: nn.Module, weight: torch.Tensor) -> None:
        self.conv, self.weight = conv, weight

    def __enter__(self) -> None:
        self.saved = self.conv._parameters.pop("weight")
        self.conv.__dict__["weight"] = self.weight

    def __exit__(self, *exc: object) -> None:
        del self.conv.__dict__["weight"]
        self.conv._parameters["weight"] = self.saved


class SpatialMaxPoolSame(_SamePadded, SpatialMaxPool):
    """timm's MaxPool2dSame on a tile."""


def convert_same_padded(is_conv: bool, standardises: bool, module: nn.Module, name: str, runtime: SpatialRuntime,
                        _: Convert) -> nn.Module:
    """``module`` (one of timm's same-padded convs, ``standardises``: its weight, or its same-padded max pool) as its
    spatial layer."""
    new: SpatialStdConv | SpatialMaxPoolSame
    if is_conv:
        assert isinstance(module, nn.Conv2d)
        new = adopt(SpatialStdConv, module, runtime, name)
        new.windows = conv_axis_windows(module)
        new.standardises = standardises
        new.pads_dynamically = bool(getattr(module, "same_pad", type(module).__name__ == "Conv2dSame"))
    else:
        assert isinstance(module, nn.MaxPool2d)
        new = SpatialMaxPoolSame.from_module(module, runtime, name)
        new.pads_dynamically = True
    runtime.partial_parameters.extend(module.parameters(recurse=False))
    return new


STD_CONVS = Family("TF-same padded layers (timm StdConv2d, StdConv2dSame: weight-standardised)", TimmMatch((
    "timm.layers.StdConv2d", "timm.layers.StdConv2dSame"), exact=True), partial(convert_same_padded, True, True),
    "tests/mpi/vit_exact.py")
SAME_CONVS = Family("TF-same padded layers (timm Conv2dSame)", TimmMatch(("timm.layers.Conv2dSame",), exact=True),
                    partial(convert_same_padded, True, False), "tests/mpi/vit_exact.py")
SAME_MAX_POOLS = Family("TF-same padded layers (timm MaxPool2dSame)", TimmMatch((
    "timm.layers.pool2d_same.MaxPool2dSame",), exact=True), partial(convert_same_padded, False, False),
    "tests/mpi/vit_exact.py")
