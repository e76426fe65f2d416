"""Tiles whose image rows and columns are not the last two dims: permutes, flattening, and the per-pixel
work done there (LayerNorm and Linear over channels, point-wise maths), exact on tiles.
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .guard import DECLINED, OpFamilyHandlers, SpatialGuard
from .guard_rules import TEMPLATE_ONLY, in_place
from .ops import Args, Kwargs, OpKind, TorchOp, argument, check_pointwise, kind_of, op_name, tensors_in
from .tile_layout import STANDARD, TileLayout, flattened, moved_order, normalized_order, transposed_order
from .tile_marks import is_tiled, layout_of, mark_tiled

# dims ops on a relaid tile: name -> (position, keyword) of the dim argument, and what it does to dims
_REDUCING = {name: (1, "dim") for name in
             "sum mean amax amin prod std var logsumexp all any argmax argmin max min count_nonzero".split()}
_REDUCING["norm"] = (2, "dim")
_KEEPING = {"softmax": (1, "dim"), "log_softmax": (1, "dim"), "softmin": (1, "dim"),
            "normalize": (2, "dim"), "cumsum": (1, "dim"), "cumprod": (1, "dim"), "chunk": (2, "dim"),
            "split": (2, "dim"), "tensor_split": (2, "dim"), "narrow": (1, "dim"), "cat": (1, "dim"),
            "concat": (1, "dim"), "concatenate": (1, "dim")}
_REMOVING = {"select": (1, "dim"), "unbind": (1, "dim")}
_DEFAULT_ZERO = {"chunk", "split", "tensor_split", "cat", "concat", "concatenate", "unbind"}
_JOINING = {"cat", "concat", "concatenate"}


def _tile_argument(args: Args, kwargs: Kwargs) -> torch.Tensor | None:
    x = args[0] if args else kwargs.get("input")
    if isinstance(x, (list, tuple)) and x:
        x = x[0]
    return x if isinstance(x, torch.Tensor) and is_tiled(x) else None


def _ints(value: object) -> list[int] | None:
    items = value if isinstance(value, (list, tuple, torch.Size)) else (value,)
    return [int(v) for v in items] if all(isinstance(v, int) for v in items) else None


# ------------------------------------------------------------------- permutes and flattening
def _order(name: str, args: Args, kwargs: Kwargs, ndim: int) -> list[int] | None:
    """The permutation a permute/transpose/movedim call makes, or None."""
    if name == "permute":
        dims = _ints(args[1] if len(args) == 2 else args[1:]) if len(args) > 1 else _ints(kwargs.get("dims"))
        return normalized_order(dims, ndim) if dims is not None and len(dims) == ndim else None
    if name in ("transpose", "swapaxes", "swapdims"):
        first = argument(args, kwargs, 1, "dim0" if name != "swapaxes" else "axis0")
        second = argument(args, kwargs, 2, "dim1" if name != "swapaxes" else "axis1")
        if isinstance(first, int) and isinstance(second, int):
            return transposed_order(first, second, ndim)
        return None
    if name in ("movedim", "moveaxis"):
        source, destination = _ints(argument(args, kwargs, 1, "source")), \
            _ints(argument(args, kwargs, 2, "destination"))
        if source is not None and destination is not None and len(source) == len(destination):
            return moved_order(source, destination, ndim)
    return None


def _flattened(x: torch.Tensor, layout: TileLayout, args: Args, kwargs: Kwargs) -> TileLayout | None:
    """The layout after ``flatten(start, end)``: only merging exactly the rows and columns (in that order)."""
    ndim = x.dim()
    start = int(argument(args, kwargs, 1, "start_dim", 0))   # type: ignore[call-overload]
    end = int(argument(args, kwargs, 2, "end_dim", -1))   # type: ignore[call-overload]
    start, end = normalized_order([start, end], ndim)
    if layout.flat or (start, end) != (ndim + layout.rows, ndim + layout.cols) or end != start + 1:
        return None
    return flattened(layout.lengths(x.shape), end - ndim)


def _target_shape(x: torch.Tensor, name: str, args: Args, kwargs: Kwargs) -> list[int] | None:
    """The shape a view/reshape call asks for, with -1 resolved."""
    if name in ("view_as", "reshape_as"):
        other = args[1] if len(args) > 1 else kwargs.get("other")
        return list(other.shape) if isinstance(other, torch.Tensor) else None
    if name not in ("view", "reshape"):
        return None
    sizes = _ints(args[1] if len(args) == 2 else args[1:]) if len(args) > 1 else _ints(kwargs.get("shape"))
    if sizes is None or sizes.count(-1) > 1:
        return None
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = x.numel() // known if known else 0
    return sizes if math.prod(sizes) == x.numel() else None


def _reshaped(x: torch.Tensor, layout: TileLayout, shape: Sequence[int]) -> TileLayout | None:
    """The layout of ``x.reshape(shape)`` when it only merges the rows and columns, or splits them back."""
    shape = list(shape)
    lengths = layout.lengths(x.shape)
    if not layout.flat:   # merging the rows and the columns right after them
        rows = x.dim() + layout.rows
        if layout.cols != layout.rows + 1 or shape != [*x.shape[:rows], lengths[0] * lengths[1],
                                                       *x.shape[rows + 2:]]:
            return None
        return flattened(lengths, layout.cols)
    position = x.dim() + layout.rows
    after = x.dim() - position - 1
    split = [*x.shape[:position], *lengths, *x.shape[position + 1:]]
    if shape == split:
        return TileLayout(-after - 2, -after - 1) if after else STANDARD
    return None


def relayout(guard: SpatialGuard, func: TorchOp, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
    """The guard's handler of permutes, flattening and reshapes that move a tile's rows and columns."""
    name = op_name(func)
    x = _tile_argument(args, kwargs)
    if x is None or not isinstance(args[0] if args else kwargs.get("input"), torch.Tensor):
        return DECLINED
    layout = layout_of(x)
    order = _order(name, args, kwargs, x.dim())
    if order is not None:
        new = layout.permuted(order)
    elif name == "flatten":
        new_layout = _flattened(x, layout, args, kwargs)
        if new_layout is None:
            return DECLINED
        new = new_layout
    elif name == "unflatten" and layout.flat:
        dim = argument(args, kwargs, 1, "dim")
        sizes = _ints(argument(args, kwargs, 2, "sizes"))
        if not isinstance(dim, int) or sizes is None or (dim - x.dim() if dim >= 0 else dim) != layout.rows:
            return DECLINED
        target = list(x.shape)
        target[dim:dim + 1 if dim != -1 else None] = sizes
        relaid = _reshaped(x, layout, target)
        if relaid is None:
            return DECLINED
        new = relaid
    else:
        target_shape = _target_shape(x, name, args, kwargs)
        relaid = _reshaped(x, layout, target_shape) if target_shape is not None else None
        if relaid is None:
            return DECLINED
        new = relaid
    return mark_tiled(func(*args, **kwargs), new)


# ----------------------------------------------------------- per-pixel ops along trailing dims
def _trailing_count(name: str, args: Args, kwargs: Kwargs) -> int | None:
    if name == "linear":
        return 1
    shape = argument(args, kwargs, 1, "normalized_shape")
    dims = _ints(shape)
    return len(dims) if dims is not None else None


def per_pixel_trailing(guard: SpatialGuard, func: TorchOp, args: tuple[object, ...],
                       kwargs: dict[str, object]) -> object:
    """``F.linear`` / ``F.layer_norm`` / ``F.rms_norm`` on a tile: exact when no image dim is acted on."""
    x = _tile_argument(args, kwargs)
    count = _trailing_count(op_name(func), args, kwargs)
    if x is None or count is None:
        return DECLINED
    layout = layout_of(x)
    if any(offset >= -count for offset in layout.offsets):
        return DECLINED
    args, kwargs = guard.shared_operands(func, args, kwargs)
    return mark_tiled(func(*args, **kwargs), layout)


# --------------------------------------------------------------- other ops on a relaid tile
def _dim_of(name: str, table: dict[str, tuple[int, str]], args: Args, kwargs: Kwargs,
            ndim: int) -> list[int] | None:
    position, keyword = table[name]
    value = argument(args, kwargs, position, keyword, 0 if name in _DEFAULT_ZERO else None)
    dims = _ints(value) if value is not None else None
    return normalized_order(dims, ndim) if dims is not None else None


def _along_other_dims(guard: SpatialGuard, func: TorchOp, name: str, x: torch.Tensor, layout: TileLayout,
                      args: tuple[object, ...], kwargs: dict[str, object]) -> object:
    """Reductions, softmax, slicing, joining along dims that are not the image's."""
    table = _REDUCING if name in _REDUCING else _KEEPING if name in _KEEPING else _REMOVING
    dims = _dim_of(name, table, args, kwargs, x.dim())
    if dims is None or set(dims) & set(layout.positions(x.dim())):
        return DECLINED
    if name in _JOINING:
        joined = args[0] if args else kwargs.get("tensors", ())
        parts = list(joined) if isinstance(joined, (list, tuple)) else []
        if not all(isinstance(t, torch.Tensor) and is_tiled(t) and layout_of(t) == layout
                   and layout.lengths(t.shape) == layout.lengths(x.shape) for t in parts):
            return DECLINED
    new = layout
    keepdim = bool(argument(args, kwargs, 3 if name == "norm" else 2, "keepdim", False))
    if table is _REMOVING or (table is _REDUCING and not keepdim):
        new = layout.without(dims, x.dim())
    args, kwargs = guard.shared_operands(func, args, kwargs)
    return mark_tiled(func(*args, **kwargs), new)


def on_relaid_tile(guard: SpatialGuard, func: TorchOp, args: tuple[object, ...],
                   kwargs: dict[str, object]) -> object:
    """The guard's layout handler: point-wise maths and ops along other dims on a relaid tile."""
    name = op_name(func)
    x = _tile_argument(args, kwargs)
    kind = kind_of(func)
    if x is None:   # a relaid tile as a later argument: only point-wise maths
        first = args[0] if args else None
        if kind is not OpKind.POINTWISE or (isinstance(first, torch.Tensor) and in_place(name)):
            return DECLINED
        tiles = [t for t in tensors_in(args, kwargs) if is_tiled(t)]
        x = tiles[0]
    layout = layout_of(x)
    if kind is OpKind.DIMS and (name in _REDUCING or name in _KEEPING or name in _REMOVING):
        return _along_other_dims(guard, func, name, x, layout, args, kwargs)
    if kind is not OpKind.POINTWISE:
        return DECLINED
    operands = [x] if name in TEMPLATE_ONLY else tensors_in(args, kwargs)
    if any(is_tiled(t) and layout_of(t) != layout for t in operands) or \
            check_pointwise(operands, is_tiled, layout.offsets) is not None:
        return DECLINED
    if name in TEMPLATE_ONLY:
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.shape == x.shape:
            mark_tiled(out, layout)
        return out
    args, kwargs = guard.shared_operands(func, args, kwargs)
    return mark_tiled(func(*args, **kwargs), layout)


# the guard's handlers of relaid tiles (listed in families.OP_FAMILIES)
OP_FAMILY = OpFamilyHandlers(
    tiled={OpKind.DIMS: relayout, OpKind.SHAPE: relayout, OpKind.TRAILING: per_pixel_trailing},
    layout=on_relaid_tile)
