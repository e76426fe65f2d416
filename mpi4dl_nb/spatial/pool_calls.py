"""``F.max_pool2d`` / ``F.avg_pool2d`` (``3d`` on a volume's tiles) called in custom forwards, on tiles: computed
by the spatial pools.

Inception's blocks pool inside their ``forward`` (``F.avg_pool2d(x, kernel_size=3, stride=1,
padding=1)``, ``F.max_pool2d(x, 3, 2)``). On a tile such a call becomes the module it spells
(``nn.AvgPool2d``/``nn.MaxPool2d`` with the same arguments) and runs as ``SpatialAvgPool`` /
``SpatialMaxPool`` (``pool.py``): halo exchange with the image's padding, every padding, stride,
dilation, ``ceil_mode``, ``count_include_pad`` and ``divisor_override`` as the serial call. One spatial
pool is kept per distinct argument list (its halo plans are cached per input size and call order, as a
module's). ``return_indices=True`` stays refused (the indices would be positions in one tile).
"""

from __future__ import annotations

import torch
from torch import nn

from .guard import DECLINED, OpFamilyHandlers, SpatialGuard
from .layer import SpatialRuntime, guard_runtime
from .ops import Args, Kwargs, OpKind, TorchOp, argument, op_name
from .pool import SpatialAvgPool, SpatialMaxPool
from .tile_marks import is_tiled, layout_of, mark_tiled

_MAX_KEYS = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
_AVG_KEYS = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")


def _hashable(value: object) -> object:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _call_arguments(keys: tuple[str, ...], args: Args, kwargs: Kwargs) -> dict[str, object]:
    given = {key: argument(args, kwargs, position, key) for position, key in enumerate(keys, start=1)}
    return {key: _hashable(value) for key, value in given.items() if value is not None}


# the functional pools computed on tiles: name -> (its module, spatial class, tiled axes)
_CALLS: dict[str, tuple[type[nn.Module], type[SpatialMaxPool | SpatialAvgPool], int]] = {
    "max_pool2d": (nn.MaxPool2d, SpatialMaxPool, 2), "max_pool3d": (nn.MaxPool3d, SpatialMaxPool, 3),
    "avg_pool2d": (nn.AvgPool2d, SpatialAvgPool, 2), "avg_pool3d": (nn.AvgPool3d, SpatialAvgPool, 3)}


def spatial_pool(runtime: SpatialRuntime, name: str, arguments: dict[str, object]) -> SpatialMaxPool | SpatialAvgPool:
    """The spatial pool that computes ``F.<name>(x, **arguments)`` on tiles (one per argument list)."""
    key = ("pool call", name, tuple(sorted(arguments.items())))
    pool = runtime.plans.get(key)
    if not isinstance(pool, (SpatialMaxPool, SpatialAvgPool)):
        shown = f"F.{name}({', '.join(f'{k}={v}' for k, v in arguments.items())})"
        module, spatial, _ = _CALLS[name]
        pool = spatial.from_module(module(**arguments), runtime, shown)  # type: ignore[arg-type]
        runtime.plans[key] = pool
    return pool


def window_pool_on_tiles(guard: SpatialGuard, func: TorchOp, args: tuple[object, ...],
                         kwargs: dict[str, object]) -> object:
    """The guard's handler of functional max/avg pooling on a tile (see the module docstring)."""
    name = op_name(func)
    if name not in _CALLS:
        return DECLINED
    x = args[0] if args else kwargs.get("input")
    axes = _CALLS[name][2]
    if not (isinstance(x, torch.Tensor) and is_tiled(x)) or x.dim() != 2 + axes or not layout_of(x).standard:
        return DECLINED
    runtime = guard_runtime(guard, f"F.{name}")
    if runtime.grid.ndim != axes:
        return DECLINED
    arguments = _call_arguments(_MAX_KEYS if name.startswith("max") else _AVG_KEYS, args, kwargs)
    if arguments.pop("return_indices", False):
        raise guard.error(func, "with return_indices=True on a tile gives positions in one tile; pool "
                          "without indices")
    return mark_tiled(spatial_pool(runtime, name, arguments).tile_forward(x))


# the guard's handler of functional pools (listed in families.OP_FAMILIES)
OP_FAMILY = OpFamilyHandlers(
    tiled={OpKind.WINDOW: window_pool_on_tiles})
