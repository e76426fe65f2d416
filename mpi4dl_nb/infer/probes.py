"""The network probed before the windows run: output size of an input, halos against tiles, the window that fits
the memory budget."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from torch import nn

from ..config import ConfigError
from ..measure.heap import PeakMeter
from ..spatial.geometry import TileGrid
from .fully_conv import FullyConvolutional
from .windows import AxisField, round_up


def check_halos(net: nn.Module, grid: TileGrid, sizes: Sequence[tuple[int, ...]], channels: int = 3) -> None:
    """Refuse, before any window runs, window sizes (2 or 3 axes) whose tiles are thinner than some layer's halo."""
    from ..spatial.fit import halo_checked

    with halo_checked(net, grid) as probe:
        dtype = next((p.dtype for p in probe.parameters()), torch.float32)
        try:
            for size in sorted(sizes):
                with torch.no_grad():
                    probe(torch.empty(1, channels, *size, device="meta", dtype=dtype))
        except ConfigError as err:
            raise ConfigError("--window", f"{err.detail} -- a window is split over {' x '.join(map(str, grid.shape))} "
                              f"ranks; give each a larger --window or use fewer --num-spatial-parts") from err


def output_size(net: nn.Module, height: int, width: int, channels: int = 3) -> tuple[int, int]:
    """The network's output cells for an input of ``height x width`` (meta device)."""
    rows, cols = output_sizes(net, (height, width), channels)
    return rows, cols


def output_sizes(net: nn.Module, sizes: Sequence[int], channels: int) -> tuple[int, ...]:
    """The network's output cells along every spatial axis for an input of ``sizes`` (meta device)."""
    probe = copy.deepcopy(net).to("meta")
    dtype = next((p.dtype for p in probe.parameters()), torch.float32)
    with torch.no_grad():
        out = probe(torch.empty(1, channels, *sizes, device="meta", dtype=dtype))
    return tuple(int(n) for n in out.shape[2:])


def input_channels(net: nn.Module) -> int:
    """Channels the network's first convolution reads."""
    first = next((m for m in net.modules() if isinstance(m, nn.modules.conv._ConvNd)), None)
    if first is None:
        raise ConfigError("--checkpoint", "the network has no convolution: nothing to stream in windows")
    return int(first.in_channels)


def default_window(net: FullyConvolutional, fields: tuple[AxisField, AxisField], grid: TileGrid,
                   budget: int, dtype: torch.dtype, slide: tuple[int, int]) -> int:
    """Pixels per rank per window so one window's forward stays within ``budget`` bytes per rank.

    Measures the heap peak of one serial forward on a small probe (bytes per input pixel,
    overestimated by fixed costs: safe), then takes the largest square window in budget;
    at least the smallest useful window, at most what covers the slide.
    """
    unit = max(f.unit for f in fields)
    side = round_up(max(256, 2 * net.shape.min_side), unit)
    meter = PeakMeter(torch.device("cpu"))
    meter.watch(net.modules())
    x = torch.rand(1, 3, side, side, dtype=dtype)
    meter.start()
    with torch.no_grad():
        net(x)
    meter.sample()
    meter.unwatch()
    per_pixel = max(meter.peak, 1) / (side * side) if meter.source != "none" else 64 * dtype.itemsize
    window = int(math.sqrt(budget / per_pixel)) // unit * unit
    smallest = max(-(-f.min_input() // p) for f, p in zip(fields, (grid.rows, grid.cols)))
    largest = max(-(-s // p) for s, p in zip(slide, (grid.rows, grid.cols)))
    largest = max(largest, *(f.min_input() for f in fields))
    return int(min(max(window, round_up(smallest, unit)), round_up(largest, unit)))

