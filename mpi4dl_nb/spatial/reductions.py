"""Reductions over the image's rows and columns on tiles (sum, mean, amax/amin, max/min, var/std, norm,
adaptive pools to 1x1), in any spelling: the replicated result on every tile, with exact gradients.
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from ..comm.handles import Group
from ..comm.protocol import Comm
from .function_ctx import FunctionContext
from .guard import DECLINED, OpFamilyHandlers, SpatialGuard
from .layer import SizeKey, SpatialRuntime, guard_runtime
from .ops import ALL, Args, Kwargs, OpKind, TorchOp, argument, op_name
from .reduce import replicated_sum
from .tile_layout import TileLayout
from .tile_marks import is_tiled, layout_of

_SUMS = {"sum", "mean", "var", "std", "norm"}
_EXTREMA = {"amax": True, "amin": False, "max": True, "min": False}
_ADAPTIVE = {"adaptive_avg_pool2d", "adaptive_max_pool2d"}
_KEEPDIM = {"norm": 3, "var": 3, "std": 3}   # position of keepdim where it is not 2 (var(x, dim, unbiased, keepdim))

Dims = tuple[int, ...]


REDUCTION = SizeKey("reduction")


def _reduced_dims(name: str, args: Args, kwargs: Kwargs, x: torch.Tensor) -> Dims | None:
    """The dims ``name`` reduces (all of them when none are given); None when not a reduction call."""
    if name in _ADAPTIVE:
        size = argument(args, kwargs, 1, "output_size")
        sizes = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        return (x.dim() - 2, x.dim() - 1) if sizes == (1, 1) else None
    if name in ("max", "min") and (len(args) > 1 or "dim" in kwargs or "other" in kwargs):
        return None   # x.max(dim) returns indices; max(a, b) is point-wise
    position = 2 if name == "norm" else 1
    value = argument(args, kwargs, position, "dim", ALL)
    if name in ("var", "std") and isinstance(value, bool):
        value = ALL   # var(x, unbiased)
    if value is ALL or value is None:
        return tuple(range(x.dim()))
    dims = value if isinstance(value, (tuple, list)) else (value,)
    if not all(isinstance(d, int) for d in dims):
        return None
    return tuple(sorted({d + x.dim() if d < 0 else d for d in dims}))


def _global(layout: TileLayout, dims: Dims, ndim: int) -> bool:
    return set(layout.positions(ndim)) <= set(dims)


def reduce_on_tiles(guard: SpatialGuard, func: TorchOp, args: tuple[object, ...],
                    kwargs: dict[str, object]) -> object:
    """The guard's handler of reductions over a tile's rows and columns (see the module docstring)."""
    name = op_name(func)
    x = args[0] if args else kwargs.get("input")
    if name not in _SUMS and name not in _EXTREMA and name not in _ADAPTIVE:
        return DECLINED
    if not (isinstance(x, torch.Tensor) and is_tiled(x)):
        return DECLINED
    dims = _reduced_dims(name, args, kwargs, x)
    layout = layout_of(x)
    if dims is None or not _global(layout, dims, x.dim()):
        return DECLINED
    if name in _ADAPTIVE and not layout.standard:
        return DECLINED
    runtime = guard_runtime(guard, "a reduction")
    keepdim = bool(argument(args, kwargs, _KEEPDIM.get(name, 2), "keepdim", False))
    if name in _ADAPTIVE:
        keepdim = True
        if name == "adaptive_max_pool2d":
            if argument(args, kwargs, 2, "return_indices", False):
                raise guard.error(func, "with return_indices=True on a tile gives positions in one "
                                  "tile; pool with return_indices=False")
            return _restore(global_argmax(runtime, x), dims, keepdim)
        name = "mean"
    if name in _EXTREMA:
        return _restore(global_extremum(runtime, x, dims, largest=_EXTREMA[name]), dims, keepdim)
    if name == "norm":
        p = argument(args, kwargs, 1, "p", "fro")
        if p not in (2, 2.0, "fro"):
            raise guard.error(func, f"with p={p!r} over the image on tiles is not supported; use p=2")
        total = replicated_sum((x * x).sum(dims, keepdim=True), runtime.ctx, runtime.group)
        return _restore(total.sqrt(), dims, keepdim)
    count = _count(runtime, x, layout, dims)
    if name in ("var", "std"):
        variance = _variance(guard, runtime, x, dims, count, _correction(args, kwargs))
        return _restore(variance.sqrt() if name == "std" else variance, dims, keepdim)
    dtype = kwargs.get("dtype")
    local = x.sum(dims, keepdim=True, dtype=dtype) if isinstance(dtype, torch.dtype) \
        else x.sum(dims, keepdim=True)
    total = replicated_sum(local, runtime.ctx, runtime.group)
    return _restore(total / count if name == "mean" else total, dims, keepdim)


def _count(runtime: SpatialRuntime, x: torch.Tensor, layout: TileLayout, dims: Dims) -> int:
    """How many elements of the whole image the reduction over ``dims`` combines."""
    height, width = runtime.image_size_of(REDUCTION, layout.lengths(x.shape))
    image = set(layout.positions(x.dim()))
    others = math.prod(int(x.shape[d]) for d in dims if d not in image)
    return others * height * width


def _correction(args: Args, kwargs: Kwargs) -> float:
    if "correction" in kwargs and kwargs["correction"] is not None:
        return float(kwargs["correction"])   # type: ignore[arg-type]
    unbiased = kwargs.get("unbiased")
    for position in (1, 2):
        if unbiased is None and len(args) > position and isinstance(args[position], bool):
            unbiased = args[position]
    return 0.0 if unbiased is False else 1.0


def _variance(guard: SpatialGuard, runtime: SpatialRuntime, x: torch.Tensor, dims: Dims, count: int,
              correction: float) -> torch.Tensor:
    mean = replicated_sum(x.sum(dims, keepdim=True), runtime.ctx, runtime.group) / count
    centered = x - guard.shared(mean)
    squares = replicated_sum((centered * centered).sum(dims, keepdim=True), runtime.ctx, runtime.group)
    return squares / max(count - correction, 0.0)


def _restore(result: torch.Tensor, dims: Dims, keepdim: bool) -> torch.Tensor:
    """``result`` (reduced with keepdim) in the shape the call asked for."""
    if keepdim:
        return result
    for d in sorted(dims, reverse=True):
        result = result.squeeze(d)
    return result


# --------------------------------------------------------------------------- extrema
class _ExtremumCtx(FunctionContext, Protocol):
    dims: Dims
    comm: Comm
    group: Group | None


def tile_slots(local: torch.Tensor, runtime: SpatialRuntime) -> torch.Tensor:
    """Every tile's ``local`` (same shape on each), stacked in tile order on every tile."""
    slots = local.new_zeros((len(runtime.ranks), *local.shape))
    slots[runtime.tile] = local
    return runtime.ctx.all_reduce(slots, group=runtime.group)


class _GlobalExtremum(torch.autograd.Function):
    """amax/amin over ``dims`` of every tile (kept dims); backward splits the gradient between ties."""

    @staticmethod
    def forward(fctx: _ExtremumCtx, x: torch.Tensor, dims: Dims, largest: bool,
                runtime: SpatialRuntime) -> torch.Tensor:
        local = x.amax(dims, keepdim=True) if largest else x.amin(dims, keepdim=True)
        slots = tile_slots(local.detach(), runtime)
        result = slots.amax(0) if largest else slots.amin(0)
        fctx.dims, fctx.comm, fctx.group = dims, runtime.ctx, runtime.group
        fctx.save_for_backward(x, result)
        return result

    @staticmethod
    def backward(fctx: _ExtremumCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, result = fctx.saved_tensors
        mask = x == result
        count = mask.sum(fctx.dims, keepdim=True).to(grad.dtype)
        count = fctx.comm.all_reduce(count.contiguous(), group=fctx.group)
        return (grad / count) * mask, None, None, None


def global_extremum(runtime: SpatialRuntime, x: torch.Tensor, dims: Dims, largest: bool) -> torch.Tensor:
    """The maximum (``largest``) or minimum over ``dims`` of the whole image, on every tile (kept dims)."""
    result: torch.Tensor = _GlobalExtremum.apply(x, dims, largest, runtime)
    return result


class _ArgmaxCtx(FunctionContext, Protocol):
    shape: torch.Size
    axes: int


def _first_positions(index: torch.Tensor, local: Sequence[int], extent: Sequence[tuple[int, int]],
                     sizes: Sequence[int]) -> torch.Tensor:
    """Row-major positions in the whole image (volume) of ``index``, positions in a tile of lengths
    ``local`` that owns ``extent`` of an image of lengths ``sizes``."""
    position = torch.zeros_like(index)
    rest, stride = index, 1
    for length, (start, _), size in reversed(list(zip(local, extent, sizes))):
        position = position + (start + rest % length) * stride
        rest, stride = rest // length, stride * size
    return position


class _GlobalArgmax(torch.autograd.Function):
    """An adaptive max pool to 1 of the whole image (or volume): the first maximum in row-major order
    takes the gradient."""

    @staticmethod
    def forward(fctx: _ArgmaxCtx, x: torch.Tensor, runtime: SpatialRuntime, owner: object) -> torch.Tensor:
        axes = runtime.grid.ndim
        sizes = runtime.axis_sizes(owner, x)
        extent = runtime.grid.extent(runtime.tile, sizes)
        values, index = x.detach().flatten(-axes).max(-1)           # first maximum of this tile
        position = _first_positions(index, x.shape[-axes:], extent, sizes)
        slots = tile_slots(torch.stack([values.double(), position.double()]), runtime)
        best = slots[:, 0].amax(0)
        first = torch.where(slots[:, 0] == best, slots[:, 1], math.inf).amin(0)
        mine = (position.double() == first)
        fctx.shape, fctx.axes = x.shape, axes
        fctx.save_for_backward(index, mine)
        return best.to(x.dtype).reshape(*best.shape, *[1] * axes)

    @staticmethod
    def backward(fctx: _ArgmaxCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        index, mine = fctx.saved_tensors
        axes, shape = fctx.axes, fctx.shape
        flat = grad.new_zeros((*shape[:-axes], math.prod(shape[-axes:])))
        flat.scatter_(-1, index[..., None], (grad.flatten(-axes)[..., 0] * mine)[..., None])
        return flat.view(shape), None, None


def global_argmax(runtime: SpatialRuntime, x: torch.Tensor, owner: object = REDUCTION) -> torch.Tensor:
    """``F.adaptive_max_pool2d(x, 1)`` of the whole image (``adaptive_max_pool3d`` of a volume), on every
    tile; ``owner``: the runtime's size key of this call."""
    result: torch.Tensor = _GlobalArgmax.apply(x, runtime, owner)
    return result


# the guard's handler of reductions over the image (listed in families.OP_FAMILIES)
OP_FAMILY = OpFamilyHandlers(
    tiled={OpKind.DIMS: reduce_on_tiles, OpKind.WINDOW: reduce_on_tiles})
