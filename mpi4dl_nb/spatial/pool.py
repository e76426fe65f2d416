"""Spatial max/avg pooling (padding, stride != kernel, dilation, ceil_mode, count_include_pad
both ways, divisor_override) and global average pooling (images and volumes; a volume's global max).

``ceil_mode`` adds a last output whose window may run past the padded input: geometrically
that is extra padding after the image (-inf for max pooling, which then ignores it), and
for average pooling the divisor counts only the part of the window inside the padded
input (``count_include_pad``) or inside the image, exactly as PyTorch does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError
from . import conv as spatial_conv
from .geometry import AxisExchange, Box, LayerHalo, Window1d
from .halo import HaloExchange
from .layer import SpatialLayer, SpatialRuntime, adopt
from .reduce import replicated_sum
from .reductions import global_argmax
from .regional import Params, plan_for, windowed_by_regions


def pool_axis_windows(pool: nn.MaxPool2d | nn.AvgPool2d | nn.MaxPool3d | nn.AvgPool3d, axes: int,
                      dilation: int | Sequence[int] = 1) -> tuple[Window1d, ...]:
    """The window of a max/avg pool along each of its ``axes`` spatial axes (floor mode; see ``ceil_window``)."""
    def per_axis(value: int | Sequence[int] | None, default: int | Sequence[int]) -> tuple[int, ...]:
        value = default if value is None else value
        values = (value,) * axes if isinstance(value, int) else tuple(int(v) for v in value)
        if len(values) != axes:
            raise ValueError(f"expected an int or {axes} values, got {values}")
        return values

    k = per_axis(pool.kernel_size, 1)
    s, p, d = per_axis(pool.stride or None, k), per_axis(pool.padding, 0), per_axis(dilation, 1)
    return tuple(Window1d(k[a], s[a], d[a], p[a], p[a]) for a in range(axes))


def pool_windows(pool: nn.MaxPool2d | nn.AvgPool2d, dilation: int | Sequence[int] = 1
                 ) -> tuple[Window1d, Window1d]:
    """Row and column windows of a MaxPool2d/AvgPool2d (floor mode; see ``ceil_window``)."""
    rows, cols = pool_axis_windows(pool, 2, dilation)
    return rows, cols


def refuse_indices(pool: nn.MaxPool2d | nn.MaxPool3d, name: str) -> None:
    """ConfigError for a max pool returning its indices (they would be tile-local)."""
    if pool.return_indices:
        raise ConfigError("model", f"{name or type(pool).__name__}: return_indices=True is not supported by "
                          f"spatial parallelism (indices would be tile-local); use return_indices=False")


def ceil_window(window: Window1d, size: int) -> Window1d:
    """``window`` in ceil mode on an input of ``size``: extra padding after the input so
    that floor-mode counting gives PyTorch's ceil-mode output length."""
    p, s = window.pad_before, window.stride
    out = -(-(size + 2 * p - window.span) // s) + 1
    if (out - 1) * s >= size + p:     # the last window must start inside the image or left padding
        out -= 1
    after = max(window.pad_after, (out - 1) * s + window.span - size - p)
    return Window1d(window.kernel, s, window.dilation, p, after)


class _WindowedPool(SpatialLayer):
    windows: tuple[Window1d, Window1d]
    pad_value: float = 0.0
    ceil_mode: bool

    def sized_windows(self, height: int, width: int) -> tuple[Window1d, Window1d]:
        rows, cols = self.windows
        if self.ceil_mode:
            return ceil_window(rows, height), ceil_window(cols, width)
        return rows, cols

    def geometry(self, height: int, width: int) -> LayerHalo:
        rows, cols = self.sized_windows(height, width)
        return LayerHalo.for_windows(self.runtime.grid, height, width, rows, cols, self.layer_name)

    def pool(self, y: torch.Tensor, padding: tuple[int, int] = (0, 0)) -> torch.Tensor:
        """The window op with symmetric native ``padding`` (average: divided by the kernel area)."""
        raise NotImplementedError

    def pool_saving(self, y: torch.Tensor, padding: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``pool``, and what ``pool_grad`` needs besides ``y`` (max pooling: the argmax)."""
        return self.pool(y, padding), None

    def pool_grad(self, grad: torch.Tensor, y: torch.Tensor, padding: tuple[int, int],
                  saved: torch.Tensor | None) -> torch.Tensor:
        """Gradient of ``pool(y, padding)`` w.r.t. ``y``."""
        raise NotImplementedError

    def _pooled(self, x: torch.Tensor) -> tuple[torch.Tensor, HaloExchange]:
        """``pool`` on the extended tile (by regions when it has an interior), and the exchange."""
        size = self.runtime.input_size(self, x)
        exchange = self._halo(size, lambda: self.runtime.exchange(self.geometry(*size),
                                                                    self.pad_value))
        if spatial_conv.REGIONS and not exchange.identity:
            op = PoolPieces(self)
            plan = plan_for(op, exchange)
            if plan is not None:
                return windowed_by_regions(x, op, exchange, plan, spatial_conv.HALO_OVERLAP), exchange
        return self.pool(exchange(x)), exchange


class PoolPieces:
    """A spatial pool's window op on pieces of its extended input (a ``RegionOp``). Max pooling
    keeps the interior's argmax (as autograd would) and recomputes the small bands' (the
    same argmax: each window is scanned in the same order as on the extended tile)."""

    def __init__(self, layer: _WindowedPool) -> None:
        self.layer = layer
        rows, cols = layer.windows
        self.spans = (rows.span, cols.span)
        self.strides = (rows.stride, cols.stride)
        # PyTorch pools accept a native padding of at most half the kernel
        self.pad_caps: tuple[int | None, int | None] = (rows.kernel // 2, cols.kernel // 2)

    def run(self, piece: torch.Tensor, params: Params, padding: tuple[int, int]) -> torch.Tensor:
        return self.layer.pool(piece, padding)

    def run_saving(self, piece: torch.Tensor, params: Params, padding: tuple[int, int]
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.layer.pool_saving(piece, padding)

    def grads(self, grad: torch.Tensor, piece: torch.Tensor, params: Params, padding: tuple[int, int],
              mask: list[bool], saved: torch.Tensor | None = None) -> tuple[torch.Tensor | None, list]:
        return (self.layer.pool_grad(grad, piece, padding, saved) if mask[0] else None), []


class SpatialMaxPool2d(_WindowedPool, nn.MaxPool2d):
    """MaxPool2d on a tile: halo exchanged with -inf beyond the image (as PyTorch pads)."""

    pad_value = float("-inf")

    @classmethod
    def from_module(cls, pool: nn.MaxPool2d, runtime: SpatialRuntime, name: str = "") -> SpatialMaxPool2d:
        refuse_indices(pool, name)
        new = adopt(cls, pool, runtime, name)
        new.windows = pool_windows(pool, pool.dilation)
        return new

    def pool(self, y: torch.Tensor, padding: tuple[int, int] = (0, 0)) -> torch.Tensor:
        rows, cols = self.windows
        return F.max_pool2d(y, (rows.kernel, cols.kernel), (rows.stride, cols.stride), padding,
                            (rows.dilation, cols.dilation))

    def _args(self, padding: tuple[int, int]) -> tuple[list[int], ...]:
        rows, cols = self.windows
        return ([rows.kernel, cols.kernel], [rows.stride, cols.stride], list(padding),
                [rows.dilation, cols.dilation])

    def pool_saving(self, y: torch.Tensor, padding: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, argmax = torch.ops.aten.max_pool2d_with_indices(y, *self._args(padding), False)
        return out, argmax

    def pool_grad(self, grad: torch.Tensor, y: torch.Tensor, padding: tuple[int, int],
                  saved: torch.Tensor | None) -> torch.Tensor:
        argmax = saved if saved is not None else self.pool_saving(y, padding)[1]
        return torch.ops.aten.max_pool2d_with_indices_backward(grad, y, *self._args(padding), False, argmax)

    def apply_padded(self, y: torch.Tensor, inside: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        """The pooling on an input that already holds its halo and -inf padding."""
        return self.pool(y)

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._pooled(x)[0]


class SpatialAvgPool2d(_WindowedPool, nn.AvgPool2d):
    """AvgPool2d on a tile; ``count_include_pad=False`` divides by the in-image window count."""

    _counts: dict[tuple[tuple[int, int], Box, torch.dtype, torch.device], torch.Tensor]

    @classmethod
    def from_module(cls, pool: nn.AvgPool2d, runtime: SpatialRuntime, name: str = "") -> SpatialAvgPool2d:
        new = adopt(cls, pool, runtime, name)
        new.windows = pool_windows(pool)
        object.__setattr__(new, "_counts", {})
        return new

    def _window_counts(self, shape: tuple[int, int], inside: tuple[int, int, int, int],
                       like: torch.Tensor) -> torch.Tensor:
        """Per output position, the fraction of its window inside the image."""
        key = (shape, inside, like.dtype, like.device)
        counts = self._counts.get(key)
        if counts is None:
            mask = torch.zeros((1, 1, *shape), dtype=like.dtype, device=like.device)
            r0, r1, c0, c1 = inside
            mask[..., r0:r1, c0:c1] = 1
            rows, cols = self.windows
            counts = F.avg_pool2d(mask, (rows.kernel, cols.kernel), (rows.stride, cols.stride), 0)
            self._counts[key] = counts
        return counts

    def pool(self, y: torch.Tensor, padding: tuple[int, int] = (0, 0)) -> torch.Tensor:
        rows, cols = self.windows
        return F.avg_pool2d(y, (rows.kernel, cols.kernel), (rows.stride, cols.stride), padding)

    def pool_grad(self, grad: torch.Tensor, y: torch.Tensor, padding: tuple[int, int],
                  saved: torch.Tensor | None) -> torch.Tensor:
        rows, cols = self.windows
        return torch.ops.aten.avg_pool2d_backward(grad, y, [rows.kernel, cols.kernel],
                                                  [rows.stride, cols.stride], list(padding), False, True, None)

    def divided(self, out: torch.Tensor, shape: tuple[int, int],
                inside: tuple[int, int, int, int] | None) -> torch.Tensor:
        """``pool`` of an input of ``shape`` (halo and zero padding held) divided as the layer
        divides: ``inside`` is the in-image part of the input (local coordinates)."""
        rows, cols = self.windows
        if self.divisor_override:
            return out * (rows.kernel * cols.kernel / self.divisor_override)
        if inside is not None and inside != (0, shape[0], 0, shape[1]):
            return out / self._window_counts(shape, inside, out)
        return out

    def apply_padded(self, y: torch.Tensor, inside: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        """The pooling on an input that already holds its halo and zero padding;
        ``inside`` is the in-image part of ``y`` (local coordinates), for the divisor."""
        return self.divided(self.pool(y), (y.shape[-2], y.shape[-1]), inside)

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        out, exchange = self._pooled(x)
        shape = (exchange.rows.needed_len, exchange.cols.needed_len)
        return self.divided(out, shape, self.counted_box(exchange.rows, exchange.cols))

    def counted_box(self, rows: AxisExchange, cols: AxisExchange) -> tuple[int, int, int, int]:
        """The part of the exchanged input a window's divisor counts, in local coordinates:
        the image, or with count_include_pad the padded input (not ceil mode's overhang)."""
        box = []
        for plan, window in zip((rows, cols), self.windows):
            extra = window.pad_before if self.count_include_pad else 0
            start, stop = -extra - plan.needed[0], plan.size + extra - plan.needed[0]
            box += [max(0, start), min(plan.needed_len, stop)]
        return (box[0], box[1], box[2], box[3])


def check_pooled_to_one(pool: nn.Module, output_size: object, axes: int, name: str) -> None:
    """ConfigError unless an adaptive pool's ``output_size`` is 1 along each of its ``axes`` axes."""
    sizes = tuple(output_size) if isinstance(output_size, (tuple, list)) else (output_size,) * axes
    if sizes != (1,) * axes or getattr(pool, "return_indices", False):
        kind = type(pool).__name__
        raise ConfigError("model", f"{name or kind}: only output_size 1 without indices is supported by "
                          f"spatial parallelism, got output_size={output_size}; use {kind}(1) or a "
                          f"{kind.replace('Adaptive', '')} with a window")


class _GlobalAvgPool(SpatialLayer, nn.Module):
    """An adaptive average pool to 1 over the whole image (or volume): tile sums all-reduced over the tile
    group.

    The (N, C, 1, 1) result ((N, C, 1, 1, 1) for a volume) is replicated on every tile; backward assumes a
    replicated consumer (every rank holds the same output gradient) and needs no message: a consumer
    that combines it with tiles again (an SE gate) has its gradient summed over the tiles by the guard
    first, so the rule holds there too.
    """

    tiled_output = False

    @classmethod
    def from_module(cls, pool: nn.AdaptiveAvgPool2d | nn.AdaptiveAvgPool3d, runtime: SpatialRuntime,
                    name: str = "") -> Self:
        check_pooled_to_one(pool, pool.output_size, runtime.grid.ndim, name)
        return adopt(cls, pool, runtime, name)

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = math.prod(self.runtime.axis_sizes(self, x))
        dims = tuple(range(-self.runtime.grid.ndim, 0))
        total = replicated_sum(x.sum(dim=dims, keepdim=True), self.runtime.ctx, self.runtime.group)
        return total / float(positions)


class SpatialGlobalAvgPool2d(_GlobalAvgPool, nn.AdaptiveAvgPool2d):
    """AdaptiveAvgPool2d(1) over the whole image (see ``_GlobalAvgPool``)."""


class SpatialGlobalAvgPool3d(_GlobalAvgPool, nn.AdaptiveAvgPool3d):
    """AdaptiveAvgPool3d(1) over the whole volume (see ``_GlobalAvgPool``)."""


class SpatialGlobalMaxPool3d(SpatialLayer, nn.AdaptiveMaxPool3d):
    """AdaptiveMaxPool3d(1) over the whole volume: the tiles' maxima compared on every tile, the first
    maximum in the volume's row-major order takes the gradient (as the serial kernel picks it); the
    result is replicated as the global average pool's. (On an image's grid ``AdaptiveMaxPool2d(1)`` runs
    as the functional reduction the op guard computes, ``reductions.py``.)"""

    tiled_output = False

    @classmethod
    def from_module(cls, pool: nn.AdaptiveMaxPool3d, runtime: SpatialRuntime,
                    name: str = "") -> SpatialGlobalMaxPool3d:
        check_pooled_to_one(pool, pool.output_size, 3, name)
        return adopt(cls, pool, runtime, name)

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        return global_argmax(self.runtime, x, self)
