"""The cut a configuration trains with when no ``balance`` is given: by memory per rank, fitting the tiles.

Without spatial stages the layers are split evenly by count. With spatial stages the rank that holds
the first layer-parallel stage must not end up with the full-resolution activations the tiles were
meant to share, so the cut minimises the largest rank's memory (``memory_cost``), and - given the
image size - keeps on the spatial stages only layers whose halos fit the tiles (``tile_fit``). When
no cut fits, the refusal names what would: a larger image, fewer tiles; a ``balance`` given that
does not fit is refused naming the cut that does (``check_fit``, the pre-flight check).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..config import ConfigError, ParallelConfig, SliceMethod
from ..spatial.geometry import TileGrid
from .layer_memo import LayerMemo
from .stages import LayerMemory, check_balance, even_balance, layer_memory, partition_stages
from .tile_fit import (
    PROBE_ERRORS,
    ReachProbe,
    SpatialReach,
    first_layer_channels,
    larger_sizes,
    parameter_dtype,
    spatial_reach,
)

PROBE_SIZE = 256   # image side default_balance profiles at (shape-only, on meta)
# the memory probes of the last few models: the pre-flight check, the engine and the planner's cuts ask alike
_PROBED: LayerMemo[list[LayerMemory] | None] = LayerMemo()


def probe_memory(layers: Sequence[nn.Module], probe_size: int = PROBE_SIZE) -> list[LayerMemory] | None:
    """``layer_memory`` of ``layers`` on a ``probe_size`` square image (meta), or None if the
    input channels cannot be told (no conv) or the layers fail at that size. The last few results
    are kept (for the same layer objects, unchanged)."""
    return _PROBED.get(layers, probe_size, lambda: _probed_memory(layers, probe_size))


def _probed_memory(layers: Sequence[nn.Module], probe_size: int) -> list[LayerMemory] | None:
    channels = first_layer_channels(layers)
    if channels is None:
        return None
    sample = torch.empty(1, channels, probe_size, probe_size, dtype=parameter_dtype(layers), device="meta")
    try:
        return layer_memory(layers, sample)
    except PROBE_ERRORS:
        return None


def default_balance(layers: Sequence[nn.Module], cfg: ParallelConfig, probe_size: int = PROBE_SIZE,
                    probed: Sequence[LayerMemory] | None = None,
                    image_size: int | tuple[int, int] | None = None,
                    in_channels: int | None = None) -> tuple[int, ...]:
    """The balance ``cfg`` trains with: ``cfg.balance`` if given, else a rule.

    Without spatial stages, or on a volume's grid: even by layer count (``even_balance``). With spatial stages the
    rank that holds the first layer-parallel stage must not end up with the full-resolution
    activations the tiles were meant to share, so the cut is by memory per rank: each
    layer's saved-activation bytes (``layer_memory``, shape-only on ``meta`` at
    ``probe_size`` pixels square - activations of a conv net scale with the pixel count, so
    the proportions hold at any image size) divided by the tiles on a spatial stage, plus
    3x its parameter bytes (weights, gradients, momentum), plus on a layer-parallel stage
    its received input (twice after the hand-off: the joined map and its gradient's tile
    copies); the contiguous cut minimising the largest rank's bytes, with spatial stages
    ending on 4-d feature maps. Layers that cannot be probed (no conv to tell the input
    channels, or an error at that size) fall back to the even cut. ``probed``: the
    ``probe_memory`` of ``layers``, if already known.

    ``image_size`` (int or (height, width)): the cut also fits the tiles at that size - no
    spatial stage holds a layer whose halo is wider than a tile (``tile_fit``); ConfigError
    naming image sizes, a balance and tile counts that work when no cut does. None: the
    tiles are not checked (the engine then refuses a misfit at the first step).
    ``in_channels``: the images' channels (None: what the first conv takes).
    """
    if cfg.balance is not None:
        return check_balance(cfg.balance, len(layers), cfg.split_size)
    if cfg.spatial_size == 0 or cfg.volume_grid is not None:   # volumes: the memory probe and tile fit are 2-D
        return even_balance(len(layers), cfg.split_size)
    reach = None if image_size is None else spatial_reach(
        layers, TileGrid(*cfg.grid_shape), image_size, max_spatial_layers(len(layers), cfg), in_channels)
    limit = len(layers) if reach is None else reach.limit(len(layers))
    if cfg.split_size == 1 and limit >= len(layers):   # one stage holds every layer: no cut to weigh
        return (len(layers),)
    memory = list(probed) if probed is not None else probe_memory(layers, probe_size)
    balance = fitting_cut(cfg, len(layers), memory, limit)
    if balance is None:
        assert reach is not None, "without a fit limit every cut is allowed"
        raise no_fitting_cut(layers, cfg, reach, memory)
    return balance


def check_fit(layers: Sequence[nn.Module], cfg: ParallelConfig, image_size: int | tuple[int, int],
              in_channels: int | None = None) -> tuple[int, ...]:
    """The engine's cut at ``image_size`` (``default_balance``), its spatial stages checked to fit
    the tiles: ConfigError naming the first layer that does not (for a ``cfg.balance`` that does
    not fit, with the default cut, which does, or why none does)."""
    balance = default_balance(layers, cfg, image_size=image_size, in_channels=in_channels)
    if cfg.spatial_size == 0:
        return balance
    reach = spatial_reach(layers, TileGrid(*cfg.grid_shape), image_size,
                          limit=sum(balance[:cfg.spatial_size]), in_channels=in_channels)
    if reach is None or reach.refusal is None:
        return balance
    hint = ""
    if cfg.balance is not None:
        try:
            fitting = default_balance(layers, cfg.with_(balance=None), image_size=image_size,
                                      in_channels=in_channels)
            hint = f"; --balance {','.join(map(str, fitting))} fits"
        except ConfigError as error:
            hint = f"; no --balance fits: {error.detail}"
    raise ConfigError(reach.refusal.knob, reach.refusal.detail + hint)


def max_spatial_layers(num_layers: int, cfg: ParallelConfig) -> int:
    """The most layers the spatial stages can hold (each later stage keeps one)."""
    return num_layers - (cfg.split_size - cfg.spatial_size)


def fitting_cut(cfg: ParallelConfig, num_layers: int, memory: Sequence[LayerMemory] | None,
                limit: int) -> tuple[int, ...] | None:
    """``default_balance``'s cut with the spatial stages inside layers ``0 .. limit-1``: by memory
    per rank (``memory``: ``probe_memory``'s), else even, else the evenest by layer count that
    fits; None if no cut keeps the spatial stages inside ``limit``."""
    def fits(stage: int, stop: int) -> bool:
        return stage >= cfg.spatial_size or stop <= limit

    if memory is not None:
        try:
            return partition_stages(num_layers, cfg.split_size, memory_cost(cfg, memory, fits))
        except ConfigError:
            pass
    even = even_balance(num_layers, cfg.split_size)
    if sum(even[:cfg.spatial_size]) <= limit:
        return even
    try:
        return partition_stages(num_layers, cfg.split_size,
                                lambda stage, start, stop: stop - start if fits(stage, stop) else float("inf"))
    except ConfigError:
        return None


StageCost = Callable[[int, int, int], float]


def memory_cost(cfg: ParallelConfig, memory: Sequence[LayerMemory],
                fits: Callable[[int, int], bool]) -> StageCost:
    """Bytes per rank of stage ``stage`` holding layers ``start:stop`` (``default_balance``'s rule);
    ``inf`` for a spatial stage not ending on a 4-d map or not allowed by ``fits(stage, stop)``."""
    saved = [0.0] + [float(m.saved_bytes) for m in memory]
    params = [0.0] + [3.0 * m.param_bytes for m in memory]
    for values in (saved, params):
        for k in range(1, len(values)):
            values[k] += values[k - 1]
    out_bytes = [float(sum(t.numel() * t.element_size() for t in m.outputs)) for m in memory]
    is_map = [bool(m.outputs) and all(t.dim() == 4 for t in m.outputs) for m in memory]

    def cost(stage: int, start: int, stop: int) -> float:
        if not fits(stage, stop):
            return float("inf")
        state = params[stop] - params[start]
        activations = saved[stop] - saved[start]
        if stage < cfg.spatial_size:
            if not is_map[stop - 1]:
                return float("inf")
            return activations / cfg.num_spatial_parts + state
        received = out_bytes[start - 1] if start > 0 else 0.0
        if stage == cfg.spatial_size:
            received *= 2
        return activations + state + received
    return cost


def no_fitting_cut(layers: Sequence[nn.Module], cfg: ParallelConfig, reach: SpatialReach,
                   memory: Sequence[LayerMemory] | None) -> ConfigError:
    """The refusal when no cut fits the tiles: the first layer that does not fit, then what would:
    a larger image size (with the default cut there) or fewer spatial parts at this size."""
    height, width = reach.image_size
    rows, cols = reach.grid
    num = len(layers)
    why = reach.refusal.detail if reach.refusal is not None else "it does not fit"
    ways = []
    channels = first_layer_channels(layers)
    if channels is not None:
        with ReachProbe(layers, TileGrid(rows, cols), channels, parameter_dtype(layers)) as probe:
            for size in larger_sizes(reach.image_size):
                larger = probe.reach(*size, limit=max_spatial_layers(num, cfg))
                cut = None if larger.unknown else fitting_cut(cfg, num, memory, larger.limit(num))
                if cut is not None:
                    side = str(size[0]) if size[0] == size[1] else f"{size[0]}x{size[1]}"
                    ways.append(f"--image-size {side} fits (there the default cut is --balance "
                                f"{','.join(map(str, cut))})")
                    break
    for parts in fewer_parts(cfg):
        try:
            smaller = cfg.with_(num_spatial_parts=parts)
        except ConfigError:
            continue
        found = spatial_reach(layers, TileGrid(*smaller.grid_shape), (height, width),
                              limit=max_spatial_layers(num, cfg))
        if found is not None and not found.unknown and fitting_cut(smaller, num, memory, found.limit(num)) is not None:
            ways.append(f"--num-spatial-parts {parts} fits this image size")
            break
    if not ways:
        ways.append("use fewer spatial parts or a larger image size")
    return ConfigError("image_size", f"no stage cut of the {num} layers fits {rows}x{cols} tiles of a "
                       f"{height}x{width} image: the spatial stages need {cfg.spatial_size} layer(s) "
                       f"from the start and layer {reach.layers} does not fit ({why}); "
                       + "; or ".join(ways))


def fewer_parts(cfg: ParallelConfig) -> list[int]:
    """Smaller tile counts of ``cfg``'s slice method, largest first (square: perfect squares)."""
    if cfg.grid is not None:
        return []
    square = cfg.slice_method is SliceMethod.SQUARE
    return [p for p in range(cfg.num_spatial_parts - 1, 1, -1) if not square or math.isqrt(p) ** 2 == p]
