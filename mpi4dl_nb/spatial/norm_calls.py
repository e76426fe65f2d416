"""Functional norms called in custom forwards, on tiles: ``F.batch_norm`` (training), ``F.group_norm`` and
``F.instance_norm``, with statistics over the whole image.
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .batchnorm_fn import tile_batch_norm
from .guard import DECLINED, OpFamilyHandlers, SpatialGuard
from .layer import SizeKey, guard_runtime
from .norm import group_norm_tile, instance_norm_tile, tile_shape, update_running
from .ops import Args, Kwargs, OpKind, TorchOp, argument, op_name
from .tile_marks import is_tiled, layout_of, mark_tiled

NORM_CALL = SizeKey("norm call")


def _tensor(value: object) -> torch.Tensor | None:
    return value if isinstance(value, torch.Tensor) else None


def _number(args: Args, kwargs: Kwargs, position: int, keyword: str, default: float) -> float:
    value = argument(args, kwargs, position, keyword, default)
    return float(value) if isinstance(value, (int, float)) else default


def norm_on_tiles(guard: SpatialGuard, func: TorchOp, args: tuple[object, ...],
                  kwargs: dict[str, object]) -> object:
    """The guard's handler of functional norms on a tile (see the module docstring)."""
    name = op_name(func)
    if name == "batch_norm" and (func is not F.batch_norm or not argument(args, kwargs, 5, "training", False)):
        return DECLINED   # eval mode: per channel, passes the guard's check; below F.: refused
    if name == "instance_norm" and not argument(args, kwargs, 5, "use_input_stats", True):
        return DECLINED
    x = args[0] if args else kwargs.get("input")
    if not (isinstance(x, torch.Tensor) and is_tiled(x)):
        return DECLINED
    runtime = guard_runtime(guard, f"F.{name}")
    if x.dim() != 2 + runtime.grid.ndim or not layout_of(x).standard:
        raise guard.error(func, f"needs an {tile_shape(runtime)} tile, got a {x.dim()}-d one with its "
                          f"{layout_of(x).describe()}")
    if name == "group_norm":
        groups = argument(args, kwargs, 1, "num_groups")
        if not isinstance(groups, int):
            return DECLINED
        return mark_tiled(group_norm_tile(
            runtime, NORM_CALL, x, groups, guard.shared(_tensor(argument(args, kwargs, 2, "weight"))),
            guard.shared(_tensor(argument(args, kwargs, 3, "bias"))), _number(args, kwargs, 4, "eps", 1e-5)))
    running_mean = _tensor(argument(args, kwargs, 1, "running_mean"))
    running_var = _tensor(argument(args, kwargs, 2, "running_var"))
    weight = guard.shared(_tensor(argument(args, kwargs, 3, "weight")))
    bias = guard.shared(_tensor(argument(args, kwargs, 4, "bias")))
    momentum = _number(args, kwargs, 6, "momentum", 0.1)
    eps = _number(args, kwargs, 7, "eps", 1e-5)
    running = (running_mean, running_var) if running_mean is not None and running_var is not None else None
    if name == "instance_norm":
        return mark_tiled(instance_norm_tile(runtime, NORM_CALL, x, running, weight, bias, momentum, eps))
    count = float(x.shape[0] * math.prod(runtime.axis_sizes(NORM_CALL, x)) * runtime.stats_copies)
    y, mean, var = tile_batch_norm(x, weight, bias, count, eps, runtime.ctx, runtime.stats_group)
    if running is not None:
        update_running(running[0], running[1], mean, var, count, momentum)
    return mark_tiled(y)


def norm_on_volume_tiles(guard: SpatialGuard, func: TorchOp, args: tuple[object, ...],
                         kwargs: dict[str, object]) -> object:
    """``norm_on_tiles`` on a volume's tiles, for the three norms only (other per-channel ops are the guard's)."""
    return norm_on_tiles(guard, func, args, kwargs) if op_name(func) in _NORMS else DECLINED


_NORMS = {"batch_norm", "group_norm", "instance_norm"}

# the guard's handlers of functional norms (listed in families.OP_FAMILIES)
OP_FAMILY = OpFamilyHandlers(
    tiled={OpKind.CHANNEL: norm_on_tiles, OpKind.NORM: norm_on_tiles},
    volume={OpKind.CHANNEL: norm_on_volume_tiles, OpKind.NORM: norm_on_volume_tiles})
