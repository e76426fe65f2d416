"""Training-mode dropout on tiles, exact: each tile takes its slice of the mask one process draws.
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .guard import DECLINED, OpFamilyHandlers, SpatialGuard
from .layer import SizeKey, SpatialRuntime, guard_runtime
from .ops import Args, Kwargs, OpKind, TorchOp, argument, display_name, kind_of, op_name, tensors_in
from .tile_layout import TileLayout
from .tile_marks import is_tiled, layout_of, mark_tiled

_ELEMENTWISE = {"dropout"}
_FEATURE = {"dropout1d", "dropout2d", "dropout3d", "feature_alpha_dropout", "feature_dropout"}
_STATE_CHECKED = "random state"


DROPOUT = SizeKey("dropout")


def _training(name: str, args: Args, kwargs: Kwargs) -> bool:
    position = 3 if name.startswith("rrelu") else 2
    default = not name.startswith("rrelu")
    keyword = "train" if "train" in kwargs else "training"
    return bool(argument(args, kwargs, position, keyword, default))


def _device(args: Args, kwargs: Kwargs) -> torch.device:
    tensors = tensors_in(args, kwargs)
    if tensors:
        return tensors[0].device
    device = kwargs.get("device")
    if isinstance(device, (str, torch.device)):
        return torch.device(device)
    return torch.get_default_device()


def random_state_digest(device: torch.device) -> list[int]:
    """Two 48-bit numbers digesting the random state ops on ``device`` draw from (exact in float64 too)."""
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    digest = hashlib.sha1(state.numpy().tobytes()).digest()
    return [int.from_bytes(digest[:6], "little"), int.from_bytes(digest[6:12], "little")]


def check_random_state(guard: SpatialGuard, func: TorchOp, device: torch.device) -> None:
    """Once per forward: every tile's rank must draw from the same random state (ConfigError if not).

    Tile 0's digest is broadcast and each tile compares its own; a flag summed over the tiles makes
    every tile refuse together (tensor collectives, which the planner's simulated tiles answer too).
    """
    runtime = guard_runtime(guard, "dropout")
    if len(runtime.ranks) == 1 or device.type == "meta" or not guard.once_per_forward(_STATE_CHECKED):
        return
    mine = torch.tensor(random_state_digest(device), dtype=torch.int64, device=runtime.ctx.device)
    first = runtime.ctx.broadcast(mine.clone(), runtime.ranks[0], group=runtime.group)
    differs = runtime.ctx.all_reduce((first != mine).any().to(torch.int64).reshape(1), group=runtime.group)
    if int(differs.item()):
        raise ConfigError("model", f"{guard.module_path()}: {display_name(func)} draws random numbers, "
                          f"but the ranks of the tiles hold different random states, so each tile "
                          f"would draw another mask than one process does. Seed every rank alike "
                          f"before the forward (torch.manual_seed(seed) on each rank; the command "
                          f"line's --seed does), or make the op deterministic (p=0, eval mode)")


def drawn_without_tiles(guard: SpatialGuard, func: TorchOp, args: tuple[object, ...],
                        kwargs: dict[str, object]) -> object:
    """A random draw on replicated tensors (stochastic depth, dropout in a head): check the state, run it."""
    name = op_name(func)
    if kind_of(func) is OpKind.DROPOUT and (not _training(name, args, kwargs)
                                            or not argument(args, kwargs, 1, "p", 0.5)):
        return DECLINED
    if name.startswith("rrelu") and not _training(name, args, kwargs):
        return DECLINED
    check_random_state(guard, func, _device(args, kwargs))
    return DECLINED


def dropout_on_tiles(guard: SpatialGuard, func: TorchOp, args: tuple[object, ...],
                     kwargs: dict[str, object]) -> object:
    """The guard's handler of dropout (and eval-mode rrelu) on a tile (see the module docstring)."""
    name = op_name(func)
    x = args[0] if args else kwargs.get("input")
    if not (isinstance(x, torch.Tensor) and is_tiled(x)):
        return DECLINED
    layout = layout_of(x)
    if name.startswith("rrelu"):
        return DECLINED if _training(name, args, kwargs) else mark_tiled(func(*args, **kwargs), layout)
    if kind_of(func) is OpKind.RANDOM:
        return DECLINED   # refused by the guard: a random draw for one tile
    p = float(argument(args, kwargs, 1, "p", 0.5))   # type: ignore[arg-type]
    if not _training(name, args, kwargs) or p == 0:
        return mark_tiled(func(*args, **kwargs), layout)
    check_random_state(guard, func, x.device)
    runtime = guard_runtime(guard, "dropout")
    if runtime.grid.volumetric and x.dim() != 2 + runtime.grid.ndim:
        raise guard.error(func, f"on a {x.dim()}-d volume tile: only batched (N, C, D, H, W) tiles are "
                          f"supported (their mask is drawn per sample and channel, or per voxel)")
    if name in _FEATURE:
        if any(position < 2 for position in layout.positions(x.dim())):
            raise guard.error(func, f"drops whole rows of dims 0-1 of a tile with its "
                              f"{layout.describe()}: its mask would depend on the tile's size")
        return mark_tiled(func(*args, **kwargs), layout)
    if name not in _ELEMENTWISE:
        raise guard.error(func, f"(p={p}) on a tile is not supported (its noise is not a mask one "
                          f"can slice); use F.dropout or move it after the spatial stage")
    noise = serial_noise_tile(runtime, x, layout, p)
    inplace = bool(argument(args, kwargs, 3, "inplace", False))
    return mark_tiled(x.mul_(noise) if inplace else x * noise, layout)


def serial_noise_tile(runtime: SpatialRuntime, x: torch.Tensor, layout: TileLayout, p: float) -> torch.Tensor:
    """This tile's slice of ``F.dropout(ones of the whole image's shape, p)`` (0 or 1/(1-p))."""
    if runtime.grid.volumetric:
        return volume_noise_tile(runtime, x, p)
    height, width = runtime.image_size_of(DROPOUT, layout.lengths(x.shape))
    r0, r1, c0, c1 = runtime.grid.tile_box(runtime.tile, height, width)
    positions = layout.positions(x.dim())
    shape = list(x.shape)
    if layout.flat:
        shape[positions[0]] = height * width
    else:
        shape[positions[0]], shape[positions[1]] = height, width
    noise = F.dropout(_ones_laid_out_like(x, shape), p, True)
    if layout.flat:
        rows = torch.arange(r0, r1, device=x.device)
        cols = torch.arange(c0, c1, device=x.device)
        return noise.index_select(positions[0], (rows[:, None] * width + cols[None, :]).reshape(-1))
    return noise.narrow(positions[0], r0, r1 - r0).narrow(positions[1], c0, c1 - c0)


def volume_noise_tile(runtime: SpatialRuntime, x: torch.Tensor, p: float) -> torch.Tensor:
    """This volume tile's (``(N, C, d, h, w)``) slice of ``F.dropout(ones of the whole volume's shape, p)``."""
    axes = runtime.grid.ndim
    sizes = runtime.axis_sizes(DROPOUT, x)
    noise = F.dropout(_ones_laid_out_like(x, [*x.shape[:-axes], *sizes]), p, True)
    for dim, (start, stop) in zip(range(-axes, 0), runtime.grid.extent(runtime.tile, sizes)):
        noise = noise.narrow(dim, start, stop - start)
    return noise


def _ones_laid_out_like(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """Ones of ``shape`` whose dims lie in memory in the order of ``x``'s (outermost first)."""
    strides = x.stride()
    order = sorted(range(x.dim()), key=lambda d: -strides[d])
    physical = torch.ones([shape[d] for d in order], dtype=x.dtype, device=x.device)
    return physical.permute([order.index(d) for d in range(x.dim())])


# the guard's handlers of dropout and random draws (listed in families.OP_FAMILIES)
OP_FAMILY = OpFamilyHandlers(
    tiled={OpKind.DROPOUT: dropout_on_tiles, OpKind.RANDOM: dropout_on_tiles},
    volume={OpKind.DROPOUT: dropout_on_tiles, OpKind.RANDOM: dropout_on_tiles},
    untiled={OpKind.DROPOUT: drawn_without_tiles, OpKind.RANDOM: drawn_without_tiles})
