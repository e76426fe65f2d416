"""Spatial max/avg pooling over 2 or 3 tiled axes (padding, stride != kernel, dilation, ceil_mode,
count_include_pad both ways, divisor_override) and global pooling of the whole image or volume.

``ceil_mode`` adds a last output whose window may run past the padded input: geometrically
that is extra padding after the image (-inf for max pooling, which then ignores it), and
for average pooling the divisor counts only the part of the window inside the padded
input (``count_include_pad``) or inside the image, exactly as PyTorch does: the window sums are divided
by those counts, per axis from the geometry. For backward a pool keeps no tile: max pooling only its
argmax indices, average pooling nothing but sizes (their gradient kernels read only the input's shape);
by regions (``regional.py``) where the tile has an interior, else on the extended tile.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol, Self

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError
from . import conv as spatial_conv
from .function_ctx import FunctionContext
from .geometry import AxisExchange, KernelAxis, Range
from .halo import HaloExchange
from .halo_blocks import at
from .kernel_layer import Inside, SpatialKernelLayer
from .layer import SpatialLayer, SpatialRuntime, adopt
from .reduce import replicated_sum
from .reductions import global_argmax
from .regional import Padding, Params, plan_for, shaped, windowed_by_regions

_MAX: dict[int, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    2: torch.ops.aten.max_pool2d_with_indices, 3: torch.ops.aten.max_pool3d_with_indices}
_MAX_BACK: dict[int, Callable[..., torch.Tensor]] = {
    2: torch.ops.aten.max_pool2d_with_indices_backward, 3: torch.ops.aten.max_pool3d_with_indices_backward}
_SUMS: dict[int, Callable[..., torch.Tensor]] = {2: F.avg_pool2d, 3: F.avg_pool3d}
_SUMS_BACK: dict[int, Callable[..., torch.Tensor]] = {
    2: torch.ops.aten.avg_pool2d_backward, 3: torch.ops.aten.avg_pool3d_backward}

Pool = nn.MaxPool2d | nn.AvgPool2d | nn.MaxPool3d | nn.AvgPool3d


def pool_axis_windows(pool: Pool, axes: int, dilation: int | Sequence[int] = 1) -> tuple[KernelAxis, ...]:
    """The window of a max/avg pool along each of its ``axes`` spatial axes (floor mode; see ``ceil_kernel``)."""
    def per_axis(value: int | Sequence[int] | None, default: int | Sequence[int]) -> tuple[int, ...]:
        value = default if value is None else value
        values = (value,) * axes if isinstance(value, int) else tuple(int(v) for v in value)
        if len(values) != axes:
            raise ValueError(f"expected an int or {axes} values, got {values}")
        return values

    k = per_axis(pool.kernel_size, 1)
    s, p, d = per_axis(pool.stride or None, k), per_axis(pool.padding, 0), per_axis(dilation, 1)
    return tuple(KernelAxis(k[a], s[a], d[a], p[a], p[a]) for a in range(axes))


def refuse_indices(pool: nn.modules.pooling._MaxPoolNd, name: str) -> None:
    """ConfigError for a max pool returning its indices (they would be tile-local)."""
    if pool.return_indices:
        raise ConfigError("model", f"{name or type(pool).__name__}: return_indices=True is not supported by "
                          f"spatial parallelism (indices would be tile-local); use return_indices=False")


class SpatialPool(SpatialKernelLayer):
    """A max or average pool on this rank's tile (see the module doc)."""

    def _lists(self, padding: Padding) -> tuple[list[int], list[int], list[int]]:
        """(kernel, stride, padding) lists of the torch kernels."""
        return [w.kernel for w in self.windows], [w.stride for w in self.windows], list(padding)

    def pool_saving(self, y: torch.Tensor, padding: Padding) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The window op with symmetric native ``padding``, and what ``pool_grad`` needs (the argmax)."""
        raise NotImplementedError

    def pool_grad(self, grad: torch.Tensor, y: torch.Tensor, padding: Padding,
                  saved: torch.Tensor | None) -> torch.Tensor:
        """Gradient of ``pool_saving(y, padding)`` w.r.t. ``y`` (of which only the shape is read)."""
        raise NotImplementedError

    def pooled(self, x: torch.Tensor) -> tuple[torch.Tensor, HaloExchange]:
        """The window op on the extended tile (by regions when it has an interior), and the exchange."""
        exchange = self.exchange_for(x)
        n = len(self.windows)
        if exchange.identity:
            return self.pool_saving(x, (0,) * n)[0], exchange
        if spatial_conv.REGIONS:
            op = PoolPieces(self)
            plan = plan_for(op, exchange)
            if plan is not None:
                return windowed_by_regions(x, op, exchange, plan, spatial_conv.HALO_OVERLAP), exchange
        out: torch.Tensor = _ExtendedPool.apply(x, self, exchange)
        return out, exchange


class _ExtendedPoolCtx(FunctionContext, Protocol):
    layer: SpatialPool
    exchange: HaloExchange
    needed: torch.Size              # the needed tile's shape (the pool's input in forward)
    kept: bool


class _ExtendedPool(torch.autograd.Function):
    """Halo exchange + the pool of the extended tile, keeping what the pool's gradient needs besides its input's
    shape (max: the argmax; average: nothing); the extended tile is neither kept nor rebuilt."""

    @staticmethod
    def forward(fctx: _ExtendedPoolCtx, x: torch.Tensor, layer: SpatialPool, exchange: HaloExchange) -> torch.Tensor:
        needed = exchange.forward_tensor(x)
        out, saved = layer.pool_saving(needed, (0,) * len(layer.windows))
        fctx.layer, fctx.exchange, fctx.needed, fctx.kept = layer, exchange, needed.shape, saved is not None
        fctx.save_for_backward(*([saved] if saved is not None else []))
        return out

    @staticmethod
    def backward(fctx: _ExtendedPoolCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        saved = fctx.saved_tensors[0] if fctx.kept else None
        layer = fctx.layer
        grad_needed = layer.pool_grad(grad.contiguous(), shaped(grad, fctx.needed), (0,) * len(layer.windows),
                                      saved)
        return fctx.exchange.backward_tensor(grad_needed), None, None


class PoolPieces:
    """A spatial pool's window op on pieces of its extended input (a ``RegionOp``). Max pooling
    keeps the interior's and the bands' argmax (as autograd would: each window is scanned in the same order as
    on the extended tile, so the same argmax); average pooling nothing."""

    reads_input = False

    def __init__(self, layer: SpatialPool) -> None:
        self.layer = layer
        self.spans = tuple(window.span for window in layer.windows)
        self.strides = tuple(window.stride for window in layer.windows)
        # PyTorch pools accept a native padding of at most half the kernel
        self.pad_caps: tuple[int | None, ...] = tuple(window.kernel // 2 for window in layer.windows)

    def run(self, piece: torch.Tensor, params: Params, padding: Padding) -> torch.Tensor:
        return self.layer.pool_saving(piece, padding)[0]

    def run_saving(self, piece: torch.Tensor, params: Params, padding: Padding
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.layer.pool_saving(piece, padding)

    def grads(self, grad: torch.Tensor, piece: torch.Tensor, params: Params, padding: Padding,
              mask: list[bool], saved: torch.Tensor | None = None) -> tuple[torch.Tensor | None, list]:
        return (self.layer.pool_grad(grad, piece, padding, saved) if mask[0] else None), []


class SpatialMaxPool(SpatialPool, nn.modules.pooling._MaxPoolNd):
    """nn.MaxPool2d / nn.MaxPool3d on a tile: halo exchanged with -inf beyond the image (as PyTorch pads)."""

    pad_value = float("-inf")

    @classmethod
    def from_module(cls, pool: nn.MaxPool2d | nn.MaxPool3d, runtime: SpatialRuntime, name: str = "") -> Self:
        refuse_indices(pool, name)
        new = adopt(cls, pool, runtime, name)
        new.windows = pool_axis_windows(pool, runtime.grid.ndim, pool.dilation)
        return new

    def _args(self, padding: Padding) -> tuple[list[int], ...]:
        return (*self._lists(padding), [w.dilation for w in self.windows])

    def pool_saving(self, y: torch.Tensor, padding: Padding) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, argmax = _MAX[len(self.windows)](y, *self._args(padding), False)
        return out, argmax

    def pool_grad(self, grad: torch.Tensor, y: torch.Tensor, padding: Padding,
                  saved: torch.Tensor | None) -> torch.Tensor:
        assert saved is not None, "max pooling's gradient needs the argmax its forward kept"
        return _MAX_BACK[len(self.windows)](grad, y, *self._args(padding), False, saved)

    def apply_padded(self, y: torch.Tensor, inside: Inside | None = None) -> torch.Tensor:
        """The pooling on an input that already holds its halo and -inf padding."""
        w = self.windows
        pool = F.max_pool3d if len(w) == 3 else F.max_pool2d
        return pool(y, [a.kernel for a in w], [a.stride for a in w], 0, [a.dilation for a in w])

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pooled(x)[0]


def window_counts(starts: range, kernel: int, counted: Range) -> tuple[int, ...]:
    """How many positions of each window ``[start, start + kernel)`` along one axis lie in ``counted`` (what
    PyTorch's average divides by)."""
    return tuple(max(0, min(start + kernel, counted[1]) - max(start, counted[0])) for start in starts)


class SpatialAvgPool(SpatialPool, nn.modules.pooling._AvgPoolNd):
    """nn.AvgPool2d / nn.AvgPool3d on a tile: window sums of the zero-padded needed tile, divided by the serial
    layer's counts (``count_include_pad=False``: the in-image window count)."""

    count_include_pad: bool
    divisor_override: int | None
    _divisors: dict[tuple[object, ...], torch.Tensor]

    @classmethod
    def from_module(cls, pool: nn.AvgPool2d | nn.AvgPool3d, runtime: SpatialRuntime, name: str = "") -> Self:
        new = adopt(cls, pool, runtime, name)
        new.windows = pool_axis_windows(pool, runtime.grid.ndim)
        object.__setattr__(new, "_divisors", {})
        return new

    def _native(self, y: torch.Tensor, padding: Padding) -> bool:
        """Whether the kernel pads ``y`` itself: always on an image's grid; a volume's (``avg_pool3d``) only when
        ``y`` is at least a window long along every axis (else ``y`` is padded first)."""
        n = len(self.windows)
        return n == 2 or not any(padding) or all(size >= w.kernel for size, w in zip(y.shape[-n:], self.windows))

    def pool_saving(self, y: torch.Tensor, padding: Padding) -> tuple[torch.Tensor, torch.Tensor | None]:
        kernel, stride, pads = self._lists(padding)
        if not self._native(y, padding):
            y, pads = F.pad(y, [p for p in reversed(padding) for _ in (0, 1)]), [0] * len(padding)
        return _SUMS[len(self.windows)](y, kernel, stride, pads, divisor_override=1), None

    def pool_grad(self, grad: torch.Tensor, y: torch.Tensor, padding: Padding,
                  saved: torch.Tensor | None) -> torch.Tensor:
        n = len(self.windows)
        if self._native(y, padding):
            return _SUMS_BACK[n](grad, y, *self._lists(padding), False, True, 1)
        padded = shaped(grad, (*y.shape[:-n], *[size + 2 * p for size, p in zip(y.shape[-n:], padding)]))
        whole = _SUMS_BACK[n](grad, padded, *self._lists((0,) * n), False, True, 1)
        return whole[at(tuple(slice(p, p + size) for p, size in zip(padding, y.shape[-n:])))]

    def divided(self, sums: torch.Tensor, counts: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """``sums`` divided as the layer divides: ``divisor_override``, or per output the window's counted
        positions (``counts``: per axis, one per output along it)."""
        if self.divisor_override:
            return sums / self.divisor_override
        kernels = [w.kernel for w in self.windows]
        if all(set(axis) == {k} for axis, k in zip(counts, kernels)):
            return sums / math.prod(kernels)
        key = (tuple(counts), sums.dtype, sums.device)
        divisor = self._divisors.get(key)
        if divisor is None:
            divisor = torch.ones((), dtype=sums.dtype, device=sums.device)
            for axis, along in enumerate(counts):
                shape = [-1] + [1] * (len(counts) - 1 - axis)
                divisor = divisor * torch.tensor(along, dtype=sums.dtype, device=sums.device).reshape(shape)
            self._divisors[key] = divisor
        return sums / divisor

    def apply_padded(self, y: torch.Tensor, inside: Inside | None = None) -> torch.Tensor:
        """The pooling on an input that already holds its halo and the serial layer's zero padding (no
        ``ceil_mode`` overhang); ``inside`` (start, stop per axis, local) is the in-image part the divisor
        counts without ``count_include_pad``, None: every position of the window counts."""
        sums = self.pool_saving(y, (0,) * len(self.windows))[0]
        n = len(self.windows)
        counts = []
        for axis, window in enumerate(self.windows):
            counted = (inside[2 * axis], inside[2 * axis + 1]) if inside is not None else (0, y.shape[axis - n])
            starts = range(0, sums.shape[axis - n] * window.stride, window.stride)
            counts.append(window_counts(starts, window.kernel, counted))
        return self.divided(sums, counts)

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        sums, exchange = self.pooled(x)
        tile = exchange.geometry.tile(exchange.tile)
        return self.divided(sums, [self._counts(plan, window, out) for plan, window, out
                                   in zip(tile.axes, self.windows, tile.out_extent)])

    def _counts(self, plan: AxisExchange, window: KernelAxis, out: Range) -> tuple[int, ...]:
        """The divisors of the outputs ``out`` along one axis: windows clipped to the padded input
        (``count_include_pad``; not ceil mode's overhang) or to the input itself."""
        pad = window.pad_before
        counted = (-pad, plan.size + pad) if self.count_include_pad else (0, plan.size)
        return window_counts(range(out[0] * window.stride - pad, out[1] * window.stride - pad, window.stride),
                             window.kernel, counted)


def check_pooled_to_one(pool: nn.Module, output_size: object, axes: int, name: str) -> None:
    """ConfigError unless an adaptive pool's ``output_size`` is 1 along each of its ``axes`` axes."""
    sizes = tuple(output_size) if isinstance(output_size, (tuple, list)) else (output_size,) * axes
    if sizes != (1,) * axes or getattr(pool, "return_indices", False):
        kind = type(pool).__name__
        raise ConfigError("model", f"layer {name!r} ({kind}, output_size={output_size}): only output_size 1 "
                          f"without indices is supported on tiles; use {kind}(1) or a "
                          f"{kind.replace('Adaptive', '')} with a window")


class SpatialGlobalAvgPool(SpatialLayer, nn.Module):
    """nn.AdaptiveAvgPool2d(1) / nn.AdaptiveAvgPool3d(1) over the whole image (or volume): tile sums all-reduced
    over the tile group.

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


class SpatialGlobalMaxPool(SpatialLayer, nn.Module):
    """nn.AdaptiveMaxPool2d(1) / nn.AdaptiveMaxPool3d(1) over the whole image (or volume): the tiles' maxima
    compared on every tile, the first maximum in row-major order takes the gradient (as the serial kernel picks
    it); the result is replicated as the global average pool's."""

    tiled_output = False

    @classmethod
    def from_module(cls, pool: nn.AdaptiveMaxPool2d | nn.AdaptiveMaxPool3d, runtime: SpatialRuntime,
                    name: str = "") -> Self:
        check_pooled_to_one(pool, pool.output_size, runtime.grid.ndim, name)
        return adopt(cls, pool, runtime, name)

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        return global_argmax(self.runtime, x, self)
