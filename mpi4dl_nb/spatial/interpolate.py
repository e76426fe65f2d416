"""Up/down-sampling on tiles (nn.Upsample, F.interpolate), exact for every separable mode.
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .geometry import AXIS_NAMES, LayerHalo, plan_axis, split_ranges
from .guard import DECLINED, OpFamilyHandlers, SpatialGuard
from .layer import SizeKey, SpatialRuntime, guard_runtime
from .ops import Args, Kwargs, OpKind, TorchOp, op_name
from .tile_layout import Axis, TileDim
from .tile_marks import is_tiled, layout_of, mark_tiled

FUNCTIONAL = SizeKey("F.interpolate")   # input_size key of F.interpolate calls in custom forwards
_PROBE_ELEMENTS = 1 << 22

Size = int | tuple[int, ...]         # an output size: one for both axes, or per axis
Scale = float | tuple[float, ...]    # a scale factor: one for both axes, or per axis


@dataclass(frozen=True)
class ResampleArgs:
    """The arguments of one ``F.interpolate`` call that decide its weights."""

    size: Size | None = None
    scale_factor: Scale | None = None
    mode: str = "nearest"
    align_corners: bool | None = None
    recompute_scale_factor: bool | None = None
    antialias: bool = False

    @classmethod
    def from_call(cls, name: str, args: Args, kwargs: Kwargs) -> ResampleArgs:
        """From a call of F.interpolate / F.upsample / F.upsample_nearest / F.upsample_bilinear."""
        keys: tuple[str, ...] = ("input", "size", "scale_factor", "mode", "align_corners",
                                 "recompute_scale_factor", "antialias")
        if name == "upsample_nearest":
            keys, kwargs = keys[:3], {**kwargs, "mode": "nearest"}
        elif name == "upsample_bilinear":
            keys, kwargs = keys[:3], {**kwargs, "mode": "bilinear", "align_corners": True}
        values: dict[str, object] = dict(zip(keys, args))
        values.update(kwargs)
        return cls(_size(values.get("size")), _scale(values.get("scale_factor")),
                   str(values.get("mode", "nearest")), _flag(values.get("align_corners")),
                   _flag(values.get("recompute_scale_factor")), bool(values.get("antialias", False)))

    @classmethod
    def of(cls, up: nn.Upsample) -> ResampleArgs:
        return cls(_size(up.size), _scale(up.scale_factor), up.mode, up.align_corners,
                   up.recompute_scale_factor)

    def axis(self, axis: int, axes: int = 2) -> ResampleArgs:
        """The same call (on ``axes`` spatial axes) restricted to its axis ``axis``, as a (1, B, n, 1) probe:
        trilinear resampling is linear along each axis, so its weights are bilinear's along one."""
        size = int(_per_axis(self.size, axes)[axis]) if self.size is not None else None
        scale = _per_axis(self.scale_factor, axes)[axis] if self.scale_factor is not None else None
        return ResampleArgs((size, 1) if size is not None else None,
                            (scale, 1.0) if scale is not None else None, _PROBE_MODES.get(self.mode, self.mode),
                            self.align_corners, self.recompute_scale_factor, self.antialias)

    def call(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, self.size, self.scale_factor, self.mode, self.align_corners,
                             self.recompute_scale_factor, self.antialias)


def _size(value: object) -> Size | None:
    """A ``size`` argument, hashable (sequences as tuples)."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, (tuple, list, torch.Size)):
        return tuple(int(v) for v in value)
    raise TypeError(f"interpolate size={value!r}: give an int or a sequence of ints")


def _scale(value: object) -> Scale | None:
    """A ``scale_factor`` argument, hashable (sequences as tuples)."""
    if value is None or isinstance(value, (int, float)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(float(v) for v in value)
    raise TypeError(f"interpolate scale_factor={value!r}: give a number or a sequence of numbers")


def _flag(value: object) -> bool | None:
    return None if value is None else bool(value)


def _per_axis(value: Size | Scale, axes: int) -> tuple[float, ...]:
    """One size or scale per axis of a call on ``axes`` spatial axes."""
    if isinstance(value, tuple):
        if len(value) != axes:
            raise ConfigError("model", f"interpolation given {len(value)} values ({value}) for {axes} axes")
        return value
    return (value,) * axes


_PROBE_MODES = {"trilinear": "bilinear"}   # the mode whose one-axis weights a mode's are
MODES = {2: ("nearest", "nearest-exact", "bilinear", "bicubic", "area"),
         3: ("nearest", "nearest-exact", "trilinear", "area")}   # modes computed on tiles, per axis count


@lru_cache(maxsize=256)
def axis_taps(spec: ResampleArgs, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, weight)``, each ``(out, K)``: output row o = sum_k weight[o,k] * input[index[o,k]].

    ``spec`` must be a one-axis spec (``ResampleArgs.axis``); probed in float64 on the CPU.
    """
    out = spec.call(torch.zeros(1, 1, size, 1, dtype=torch.float64)).shape[-2]
    chunk = max(1, _PROBE_ELEMENTS // max(out, size))
    rows: list[list[tuple[int, float]]] = [[] for _ in range(out)]
    for start in range(0, size, chunk):
        width = min(chunk, size - start)
        probe = torch.zeros(1, width, size, 1, dtype=torch.float64)
        probe[0, torch.arange(width), start + torch.arange(width), 0] = 1.0
        response = spec.call(probe)[0, :, :, 0]          # (width, out): column j of the matrix
        src, dst = torch.nonzero(response, as_tuple=True)
        for j, o in zip(src.tolist(), dst.tolist()):
            rows[o].append((start + j, float(response[j, o])))
    taps = max(1, max(len(r) for r in rows))
    index = torch.zeros(out, taps, dtype=torch.long)
    weight = torch.zeros(out, taps, dtype=torch.float64)
    for o, row in enumerate(rows):
        for k, (i, w) in enumerate(sorted(row)):
            index[o, k], weight[o, k] = i, w
        if row:
            index[o, len(row):] = row[0][0]
    return index, weight


class TilePlan:
    """One tile's exchange and local taps for one resampling at one input size (an image's or a volume's)."""

    def __init__(self, runtime: SpatialRuntime, spec: ResampleArgs, in_sizes: tuple[int, ...],
                 name: str) -> None:
        grid = runtime.grid
        plans, taps, sizes = [], [], []
        axis_names = AXIS_NAMES[-grid.ndim:]
        for axis, (size, parts) in enumerate(zip(in_sizes, grid.shape)):
            index, weight = axis_taps(spec.axis(axis, grid.ndim), size)
            out = index.shape[0]
            if out < parts:
                raise ConfigError("num_spatial_parts", f"{name}: output length {out} cannot be "
                                  f"split into {parts} tiles; use fewer spatial parts or a larger "
                                  f"image_size")
            needed = []
            for o0, o1 in split_ranges(out, parts):
                touched = index[o0:o1][weight[o0:o1] != 0]
                needed.append((int(touched.min()), int(touched.max()) + 1) if touched.numel()
                              else (o0, o0))
            plans.append(plan_axis(size, split_ranges(size, parts), needed, what=f"{name} ({axis_names[axis]})"))
            taps.append((index, weight))
            sizes.append(out)
        geometry = LayerHalo.from_axis_plans(grid, in_sizes, sizes, plans, name)
        self.exchange = runtime.exchange(geometry, 0.0)
        view = geometry.tile(runtime.tile)
        self.local: list[tuple[torch.Tensor, torch.Tensor]] = [
            (index[o0:o1] - axis_plan.needed[0], weight[o0:o1])
            for (index, weight), axis_plan, (o0, o1) in zip(taps, view.axes, grid.extent(runtime.tile, sizes))]
        self.nearest = all(w.shape[1] == 1 and bool((w == 1).all()) for _, w in taps)
        self._cast: dict[tuple[torch.dtype, torch.device], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def taps_for(self, like: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        key = (like.dtype, like.device)
        cast = self._cast.get(key)
        if cast is None:
            cast = [(i.to(like.device), w.to(like.device, like.dtype)) for i, w in self.local]
            self._cast[key] = cast
        return cast

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return apply_taps(self.exchange(x), self.taps_for(x), self.nearest)


def apply_taps(y: torch.Tensor, taps: list[tuple[torch.Tensor, torch.Tensor]], nearest: bool) -> torch.Tensor:
    """Each tiled axis of ``y`` resampled in turn (depth, rows, columns; ``taps`` one per axis): output
    ``o`` = sum_k weight[o, k] * y[index[o, k]] along the axis."""
    for axis, (index, weight) in zip(range(-len(taps), 0), taps):
        if nearest:
            y = y.index_select(axis, index[:, 0])
            continue
        shape = [1] * y.dim()
        shape[axis] = index.shape[0]
        total = y.index_select(axis, index[:, 0]) * weight[:, 0].reshape(shape)
        for k in range(1, index.shape[1]):
            total = total + y.index_select(axis, index[:, k]) * weight[:, k].reshape(shape)
        y = total
    return y


def interpolate_tile(runtime: SpatialRuntime, owner: object, x: torch.Tensor,
                     spec: ResampleArgs, name: str = "F.interpolate") -> torch.Tensor:
    """This tile's part of ``F.interpolate(full image, **spec)`` (of the full volume on a volume's grid)."""
    modes = MODES[runtime.grid.ndim]
    if spec.mode not in modes:
        what = "a volume's tiles" if runtime.grid.volumetric else "tiles"
        raise ConfigError("model", f"{name}: interpolation mode {spec.mode!r} on {what} is not "
                          f"supported; use {', '.join(modes[:-1])} or {modes[-1]}")
    sizes = runtime.axis_sizes(owner, x)
    key = ("resample", spec, sizes)
    plan = runtime.plans.get(key)
    if not isinstance(plan, TilePlan):
        plan = TilePlan(runtime, spec, sizes, name)
        runtime.plans[key] = plan
    return plan.apply(x)


def resample_replicated(runtime: SpatialRuntime, x: torch.Tensor, spec: ResampleArgs) -> torch.Tensor:
    """This tile's part of ``F.interpolate(x, **spec)`` for a replicated ``x`` (the whole input on every
    tile, e.g. a pooled 1x1 map) resampled to an image-sized output."""
    taps = [axis_taps(spec.axis(axis), int(x.shape[-2 + axis])) for axis in (0, 1)]
    r0, r1, c0, c1 = runtime.grid.tile_box(runtime.tile, taps[0][0].shape[0], taps[1][0].shape[0])
    local = [(index[o0:o1].to(x.device), weight[o0:o1].to(x.device, x.dtype))
             for (index, weight), (o0, o1) in zip(taps, ((r0, r1), (c0, c1)))]
    nearest = all(w.shape[1] == 1 and bool((w == 1).all()) for _, w in taps)
    return apply_taps(x, local, nearest)


RESAMPLE_SIZE = SizeKey("size read from a tile")   # the image lengths of sizes read from tiles


def _raw_size(args: Args, kwargs: Kwargs) -> object:
    return kwargs.get("size", args[1] if len(args) > 1 else None)


def _image_size(runtime: SpatialRuntime, size: object) -> Size | None:
    """``size`` with every ``TileDim`` (a tile's row or column count) resolved to the image's; None
    unless every length in it is one (plain ints on tiles are ambiguous)."""
    lengths = list(size) if isinstance(size, (tuple, list, torch.Size)) else [size]
    if not lengths or not all(isinstance(n, TileDim) for n in lengths):
        return None
    resolved = []
    for length in lengths:
        assert isinstance(length, TileDim)
        local = (int(length), None) if length.axis is Axis.ROWS else (None, int(length))
        rows, cols = runtime.image_axes_of(RESAMPLE_SIZE, local)
        full = rows if length.axis is Axis.ROWS else cols
        assert full is not None
        resolved.append(full)
    return tuple(resolved) if isinstance(size, (tuple, list, torch.Size)) else resolved[0]


def resample_on_tiles(guard: SpatialGuard, func: TorchOp, args: tuple[object, ...],
                      kwargs: dict[str, object]) -> object:
    """The guard's handler of ``F.interpolate`` (and its aliases) on a tile, or of a replicated tensor
    resampled to a size read from a tile: this tile's part of the result."""
    name = op_name(func)
    x = args[0] if args else kwargs["input"]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} resamples a tensor, got {type(x).__name__}")
    runtime = guard_runtime(guard, "F.interpolate")
    raw = _raw_size(args, kwargs)
    full = _image_size(runtime, raw) if raw is not None else None
    if not is_tiled(x) and full is None:
        return DECLINED   # a replicated tensor resampled to a fixed size: replicated, as serial
    if x.dim() != 4:
        raise guard.error(func, f"resamples a {x.dim()}-d tensor to tiles; only (N, C, H, W) is supported")
    spec = ResampleArgs.from_call(name, args, kwargs)
    if full is not None:
        spec = replace(spec, size=full)
    if not is_tiled(x):
        return mark_tiled(resample_replicated(runtime, guard.shared(x), spec))
    if not layout_of(x).standard:
        raise guard.error(func, f"resamples a tile with its {layout_of(x).describe()}; permute the "
                          f"rows and columns back last first")
    if raw is not None and full is None:   # e.g. size=(h * 2, w * 2): from a tile's shape, or the image's?
        raise guard.error(func, "with size= of plain numbers on a tile is ambiguous (a size computed "
                          "from a tile's shape is the tile's, not the image's); pass a size read "
                          "from a tensor's shape as it is (size=skip.shape[-2:]), use "
                          "scale_factor=, or an nn.Upsample(size=...) module with the image's size")
    return mark_tiled(interpolate_tile(runtime, FUNCTIONAL, x, spec))


# the guard's handler of resampling, also to a size read from a tile (listed in families.OP_FAMILIES)
OP_FAMILY = OpFamilyHandlers(
    tiled={OpKind.RESAMPLE: resample_on_tiles}, untiled={OpKind.RESAMPLE: resample_on_tiles})
