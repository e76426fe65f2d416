"""A volume's windowed layers on its tiles: SpatialConv3d, SpatialMaxPool3d, SpatialAvgPool3d.

Each exchanges its halo along every tiled axis (``AxesHaloExchange``: depth, rows, cols; the
layer's padding value beyond the volume) and applies the torch op without padding, which gives
exactly the tile's owned output range. ``ceil_mode`` is extra padding after the volume
(``pool.ceil_window``); average pooling divides by the serial layer's window counts, computed per
axis from the geometry (``count_include_pad`` both ways, ``divisor_override``). ``apply_padded`` runs each on an
input that already holds its halo and padding (a fused block's, ``spatial/fused.py``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .conv import autocast_operands, conv_axis_windows
from .geometry import AxisExchange, LayerHalo, Window1d
from .halo_axes import AxesHaloExchange
from .layer import SpatialLayer, SpatialRuntime, adopt
from .pool import ceil_window, pool_axis_windows, refuse_indices


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

    def exchanged(self, x: torch.Tensor) -> tuple[torch.Tensor, AxesHaloExchange]:
        """The needed tile of ``x`` (halo and padding along every axis) and its exchange."""
        sizes = self.runtime.tiled_sizes(self, x)
        exchange = self.axes_exchanges.get(sizes)
        if exchange is None:
            geometry = LayerHalo.for_axis_windows(self.runtime.grid, sizes, self.sized_windows(sizes),
                                                  self.layer_name)
            exchange = self.axes_exchanges[sizes] = self.runtime.axes_exchange(geometry, self.pad_value)
        return exchange(x), exchange


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
        needed, _ = self.exchanged(x)
        return F.conv3d(needed, weight, bias, self.stride, 0, self.dilation, self.groups)

    def apply_padded(self, y: torch.Tensor, inside: tuple[int, ...] | None = None) -> torch.Tensor:
        """The convolution on an input that already holds its halo and zero padding."""
        y, weight, bias = autocast_operands(y, self.weight, self.bias)
        return F.conv3d(y, weight, bias, self.stride, 0, self.dilation, self.groups)


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
        return self.apply_padded(self.exchanged(x)[0])

    def apply_padded(self, y: torch.Tensor, inside: tuple[int, ...] | None = None) -> torch.Tensor:
        """The pooling on an input that already holds its halo and -inf padding."""
        w = self.windows
        return F.max_pool3d(y, [a.kernel for a in w], [a.stride for a in w], 0, [a.dilation for a in w])


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
        needed, exchange = self.exchanged(x)
        w = self.windows
        sums = F.avg_pool3d(needed, [a.kernel for a in w], [a.stride for a in w], 0, divisor_override=1)
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
