"""Networks whose every output voxel depends on the whole volume (window attention, InstanceNorm): the typed mark a
layer carries, the sides they take, their fully convolutional form run as one window (the whole volume on the
ranks' tiles), and the memory a rank needs for it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ..config import ConfigError
from ..measure.heap import PeakMeter
from .fully_conv import FullyConvolutional, NetworkShape
from .probes import input_channels


@runtime_checkable
class WholeInput(Protocol):
    """A layer that makes its network's every output voxel depend on the whole input (``models/swinunetr3d.py``'s
    ``SwinInput``): inference runs such a network as one window, the whole volume split over the ranks' tiles."""

    @property
    def input_multiple(self) -> int:
        """Every side of an input is a multiple of this."""
        ...

    def check_input_sides(self, sides: tuple[int, ...]) -> None:
        """ValueError naming, for every side the network cannot take, the nearest sides it takes."""
        ...


def whole_input_layer(layers: Sequence[nn.Module]) -> WholeInput | None:
    """The layer that marks ``layers`` as needing the whole volume, None for a network that streams in windows."""
    return next((layer for layer in layers if isinstance(layer, WholeInput)), None)


def check_whole_sides(layer: WholeInput, sides: tuple[int, ...]) -> None:
    """ConfigError before any work when a volume's sides are not ones the network takes (no zero-extension: the
    output at every voxel depends on the whole volume, padding included)."""
    try:
        layer.check_input_sides(sides)
    except ValueError as err:
        raise ConfigError("--volume", f"{'x'.join(map(str, sides))} voxels: {err}; every voxel's output depends on "
                                      f"the whole volume, so it runs as one window of exactly the volume: crop or "
                                      f"pad the volume to sides that work") from err


def whole_volume_network(layers: Sequence[nn.Module]) -> FullyConvolutional:
    """``layers, Softmax`` (eval mode, sharing the weights) for a network that needs the whole volume: output stride
    1 (a voxel per voxel, checked on a small input it takes), no receptive-field probe (the field is the
    volume)."""
    layer = whole_input_layer(layers)
    assert layer is not None, "whole_volume_network takes a network marked WholeInput"
    layers = [module.eval() for module in layers]
    channels = input_channels(nn.Sequential(*layers))
    side = 2 * layer.input_multiple      # InstanceNorm needs more than one voxel on the deepest grid
    dtype = next((p.dtype for module in layers for p in module.parameters()), torch.float32)
    with torch.no_grad():
        out = nn.Sequential(*layers)(torch.zeros(1, channels, side, side, side, dtype=dtype))
    if tuple(out.shape[2:]) != (side,) * 3:
        raise ConfigError("--checkpoint", f"the network maps a {side}^3 volume to {tuple(out.shape[2:])} cells; "
                                          f"whole-volume inference takes dense networks (a class per voxel)")
    net = FullyConvolutional(*layers, nn.Softmax(dim=1)).eval()
    net.shape = NetworkShape(stride=1, align=layer.input_multiple, min_side=side, classes=int(out.shape[1]), dims=3)
    return net


def bytes_per_voxel(net: nn.Module, side: int, channels: int, dtype: torch.dtype) -> float | None:
    """Heap bytes one process's forward holds per input voxel: the growth of the peak from a ``side``^3 volume to one
    twice as wide (fixed costs cancel); None where the heap cannot be measured."""
    peaks = []
    for width in (side, 2 * side):
        meter = PeakMeter(torch.device("cpu"))
        meter.watch(net.modules())
        x = torch.zeros(1, channels, side, side, width, dtype=dtype)
        meter.start()
        with torch.no_grad():
            net(x)
        meter.sample()
        meter.unwatch()
        if meter.source == "none":
            return None
        peaks.append(meter.peak)
    return max(peaks[1] - peaks[0], 0) / side ** 3
