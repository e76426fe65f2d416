"""SpatialKernelLayer: what a spatial conv and pool share over the grid's 2 or 3 tiled axes: a kernel per axis,
its halo geometry at each input size, and the halo exchange (one per input size, cached)."""

from __future__ import annotations

import torch

from .geometry import KernelAxis, LayerHalo
from .halo import HaloExchange
from .layer import SpatialLayer

Inside = tuple[int, ...]   # (start, stop) per tiled axis, local coordinates: the in-image part of a padded input


def ceil_kernel(window: KernelAxis, size: int) -> KernelAxis:
    """``window`` in ceil mode on an input of ``size``: extra padding after the input so
    that floor-mode counting gives PyTorch's ceil-mode output length."""
    p, s = window.pad_before, window.stride
    out = -(-(size + 2 * p - window.span) // s) + 1
    if (out - 1) * s >= size + p:     # the last window must start inside the image or left padding
        out -= 1
    after = max(window.pad_after, (out - 1) * s + window.span - size - p)
    return KernelAxis(window.kernel, s, window.dilation, p, after)


class SpatialKernelLayer(SpatialLayer):
    """A conv or pool on this rank's tile: exchange the halo (``pad_value`` beyond the image), then apply the
    torch op without padding, which gives exactly the tile's owned output range."""

    windows: tuple[KernelAxis, ...]    # one per tiled axis, outermost first
    pad_value: float = 0.0
    ceil_mode: bool = False

    def sized_windows(self, sizes: tuple[int, ...]) -> tuple[KernelAxis, ...]:
        """The windows on an input of ``sizes`` (ceil mode: extra padding after the input)."""
        if self.ceil_mode:
            return tuple(ceil_kernel(window, size) for window, size in zip(self.windows, sizes))
        return self.windows

    def geometry(self, sizes: tuple[int, ...]) -> LayerHalo:
        return LayerHalo.for_axis_windows(self.runtime.grid, sizes, self.sized_windows(sizes), self.layer_name)

    def exchange_for(self, x: torch.Tensor) -> HaloExchange:
        """The halo exchange of the tile ``x`` (one per input size, cached)."""
        sizes = self.runtime.axis_sizes(self, x)
        return self._halo(sizes, lambda: self.runtime.exchange(self.geometry(sizes), self.pad_value))

    def apply_padded(self, y: torch.Tensor, inside: Inside | None = None) -> torch.Tensor:
        """The op on an input that already holds its halo and padding (a fused block's); ``inside``: its in-image
        part, for an average's divisor (None: every position counts)."""
        raise NotImplementedError
