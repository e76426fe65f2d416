"""``F.max_pool2d`` / ``F.avg_pool2d`` called in custom forwards, on tiles: computed by the spatial pools.

Inception's blocks pool inside their ``forward`` (``F.avg_pool2d(x, kernel_size=3, stride=1,
padding=1)``, ``F.max_pool2d(x, 3, 2)``). On a tile such a call becomes the module it spells
(``nn.AvgPool2d``/``nn.MaxPool2d`` with the same arguments) and runs as ``SpatialAvgPool2d`` /
``SpatialMaxPool2d`` (``pool.py``): halo exchange with the image's padding, every padding, stride,
dilation, ``ceil_mode``, ``count_include_pad`` and ``divisor_override`` as the serial call. One spatial
pool is kept per distinct argument list (its halo plans are cached per input size and call order, as a
module's). ``return_indices=True`` stays refused (the indices would be positions in one tile).
"""

from __future__ import annotations

import torch
from torch import nn

from .guard import DECLINED, SpatialGuard, is_tiled, layout_of, mark_tiled, register_handler
from .layer import SpatialRuntime, guard_runtime
from .ops import Args, Kwargs, OpKind, TorchOp, argument, op_name
from .pool import SpatialAvgPool2d, SpatialMaxPool2d

_MAX_KEYS = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
_AVG_KEYS = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")


def _hashable(value: object) -> object:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _call_arguments(keys: tuple[str, ...], args: Args, kwargs: Kwargs) -> dict[str, object]:
    given = {key: argument(args, kwargs, position, key) for position, key in enumerate(keys, start=1)}
    return {key: _hashable(value) for key, value in given.items() if value is not None}


def spatial_pool(runtime: SpatialRuntime, name: str, arguments: dict[str, object]) -> nn.Module:
    """The spatial pool that computes ``F.<name>(x, **arguments)`` on tiles (one per argument list)."""
    key = ("pool call", name, tuple(sorted(arguments.items())))
    pool = runtime.plans.get(key)
    if not isinstance(pool, nn.Module):
        shown = f"F.{name}({', '.join(f'{k}={v}' for k, v in arguments.items())})"
        if name == "max_pool2d":
            pool = SpatialMaxPool2d.from_module(nn.MaxPool2d(**arguments), runtime, shown)  # type: ignore[arg-type]
        else:
            pool = SpatialAvgPool2d.from_module(nn.AvgPool2d(**arguments), runtime, shown)  # type: ignore[arg-type]
        runtime.plans[key] = pool
    return pool


def pool_on_tiles(guard: SpatialGuard, func: TorchOp, args: tuple[object, ...],
                  kwargs: dict[str, object]) -> object:
    """The guard's handler of functional max/avg pooling on a tile (see the module docstring)."""
    name = op_name(func)
    if name not in ("max_pool2d", "avg_pool2d"):
        return DECLINED
    x = args[0] if args else kwargs.get("input")
    if not (isinstance(x, torch.Tensor) and is_tiled(x)) or x.dim() != 4 or not layout_of(x).standard:
        return DECLINED
    arguments = _call_arguments(_MAX_KEYS if name == "max_pool2d" else _AVG_KEYS, args, kwargs)
    if arguments.pop("return_indices", False):
        raise guard.error(func, "with return_indices=True on a tile gives positions in one tile; pool "
                          "without indices")
    pool = spatial_pool(guard_runtime(guard, f"F.{name}"), name, arguments)
    assert isinstance(pool, (SpatialMaxPool2d, SpatialAvgPool2d))
    return mark_tiled(pool.tile_forward(x))


register_handler(OpKind.WINDOW, pool_on_tiles)
