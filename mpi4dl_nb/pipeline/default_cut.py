"""The stage cut: the one a configuration trains with when no ``balance`` is given (by memory per rank, fitting the
tiles), and ``auto_balance``'s by profiled time or memory, both by one min-max solver (``partition_stages``).

Read top to bottom: ``check_fit`` (the pre-flight check; a ``balance`` given that does not fit the tiles is
refused naming the cut that does), ``default_balance`` (the rule), then its helpers in the order it asks them:
``fitting_cut`` (the cut minimising the largest rank's ``memory_cost`` - ``partition_stages`` - inside the layers
that fit the tiles) and the refusal when no cut fits (``no_fitting_cut``: a larger image or fewer tiles that would).
The facts it needs from other modules are asked once each and come back as plain data: how far the tiles reach at
an image size (``tile_fit.tile_reach``, over ``spatial.fit``'s halo geometry) and the memory per layer
(``layer_probe.probe_memory``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import accumulate

from torch import nn

from ..comm.messages import Payload
from ..config import ConfigError, ParallelConfig, SliceMethod
from .layer_probe import PROBE_SIZE, LayerMemory, probe_memory, profile_layer_memory, profile_layer_times
from .tile_fit import TileReach, tile_reach, tile_reaches

StageCost = Callable[[int, int, int], float]   # (stage, start, stop) -> the cost of the stage holding start:stop


def check_fit(layers: Sequence[nn.Module], cfg: ParallelConfig, image_size: int | tuple[int, int],
              in_channels: int | None = None) -> tuple[int, ...]:
    """The engine's cut at ``image_size`` (``default_balance``), its spatial stages checked to fit
    the tiles: ConfigError naming the first layer that does not (for a ``cfg.balance`` that does
    not fit, with the default cut, which does, or why none does)."""
    balance = default_balance(layers, cfg, image_size=image_size, in_channels=in_channels)
    if cfg.spatial_size == 0:
        return balance
    reach = tile_reach(layers, cfg, image_size, limit=sum(balance[:cfg.spatial_size]), in_channels=in_channels)
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


def default_balance(layers: Sequence[nn.Module], cfg: ParallelConfig, probe_size: int = PROBE_SIZE,
                    probed: Sequence[LayerMemory] | None = None,
                    image_size: int | tuple[int, int] | None = None,
                    in_channels: int | None = None) -> tuple[int, ...]:
    """The balance ``cfg`` trains with: ``cfg.balance`` if given, else a rule.

    Without spatial stages, or on a volume's grid: even by layer count (``even_balance``). With spatial stages the
    rank that holds the first layer-parallel stage must not end up with the full-resolution activations the tiles
    were meant to share, so the cut is by memory per rank (``memory_cost``), each layer's bytes probed shape-only at
    ``probe_size`` pixels square (``probe_memory``; activations of a conv net scale with the pixel count, so the
    proportions hold at any image size). Layers that cannot be probed (no conv to tell the input channels, or an
    error at that size) fall back to the even cut. ``probed``: the ``probe_memory`` of ``layers``, if known.

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
    reach = None if image_size is None else tile_reach(
        layers, cfg, image_size, max_spatial_layers(len(layers), cfg), in_channels)
    limit = len(layers) if reach is None else reach.limit
    if cfg.split_size == 1 and limit >= len(layers):   # one stage holds every layer: no cut to weigh
        return (len(layers),)
    memory = list(probed) if probed is not None else probe_memory(layers, probe_size)
    balance = fitting_cut(cfg, len(layers), memory, limit, draws_in_training(layers))
    if balance is None:
        assert reach is not None, "without a fit limit every cut is allowed"
        raise no_fitting_cut(layers, cfg, reach, memory)
    return balance


def check_balance(balance: Sequence[int], num_layers: int, split_size: int) -> tuple[int, ...]:
    """Validate a user balance; ConfigError names the fix."""
    balance = tuple(int(b) for b in balance)
    if len(balance) != split_size:
        raise ConfigError("balance", f"has {len(balance)} entries but split_size={split_size}; "
                          f"give one layer count per stage, e.g. "
                          f"{list(even_balance(num_layers, split_size))}")
    if any(b < 1 for b in balance) or sum(balance) != num_layers:
        raise ConfigError("balance", f"{list(balance)} must be positive and sum to the "
                          f"{num_layers} layers, e.g. {list(even_balance(num_layers, split_size))}")
    return balance


def even_balance(num_layers: int, split_size: int) -> tuple[int, ...]:
    """Layer counts per stage as even as possible; the later stages take the remainder."""
    if split_size < 1 or num_layers < split_size:
        raise ConfigError("split_size", f"cannot cut {num_layers} layers into {split_size} "
                          f"stages; use split_size between 1 and {num_layers}")
    base, extra = divmod(num_layers, split_size)
    return tuple(base + (1 if s >= split_size - extra else 0) for s in range(split_size))


def max_spatial_layers(num_layers: int, cfg: ParallelConfig) -> int:
    """The most layers the spatial stages can hold (each later stage keeps one)."""
    return num_layers - (cfg.split_size - cfg.spatial_size)


def fitting_cut(cfg: ParallelConfig, num_layers: int, memory: Sequence[LayerMemory] | None,
                limit: int, draws: Sequence[bool] = ()) -> tuple[int, ...] | None:
    """``default_balance``'s cut with the spatial stages inside layers ``0 .. limit-1``: by memory
    per rank (``memory``: ``probe_memory``'s; the layers that ``draws`` in training on one stage), else even, else
    the evenest by layer count that fits; None if no cut keeps the spatial stages inside ``limit``."""
    def fits(stage: int, stop: int) -> bool:
        return stage >= cfg.spatial_size or stop <= limit

    if memory is not None:
        try:
            return partition_stages(num_layers, cfg.split_size, kept_together(memory_cost(cfg, memory, fits), draws))
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


def memory_cost(cfg: ParallelConfig, memory: Sequence[LayerMemory],
                fits: Callable[[int, int], bool]) -> StageCost:
    """Bytes per rank of stage ``stage`` holding layers ``start:stop`` (``default_balance``'s rule): the layers'
    saved activations (divided by the tiles on a spatial stage), 3x their parameters (weights, gradients,
    momentum), on a layer-parallel stage its received input (twice after the hand-off: the joined map and its
    gradient's tile copies); ``inf`` for a spatial stage not ending on a 4-d map or not allowed by ``fits``."""
    saved = list(accumulate((float(m.saved_bytes) for m in memory), initial=0.0))   # prefix sums
    params = list(accumulate((3.0 * m.param_bytes for m in memory), initial=0.0))
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


def kept_together(cost: StageCost, draws: Sequence[bool]) -> StageCost:
    """``cost`` with every layer that ``draws`` random numbers in training on one stage (``inf`` for a stage holding
    some of them, not all): each rank draws from its own random state, so draws on two stages (a Swin's stochastic
    depth in every stage) would not be one process's masks."""
    held = list(accumulate((int(d) for d in draws), initial=0))
    total = held[-1] if held else 0
    if total < 2:
        return cost

    def together(stage: int, start: int, stop: int) -> float:
        return float("inf") if 0 < held[stop] - held[start] < total else cost(stage, start, stop)
    return together


def partition_stages(num_layers: int, split_size: int, cost: StageCost,
                     later_lighter: bool = False) -> tuple[int, ...]:
    """Contiguous cut of ``num_layers`` layers into ``split_size`` non-empty stages minimising
    the largest ``cost(stage, start, stop)`` (layers ``start:stop``); exact dynamic program, O(n^2 k).

    A cost of ``inf`` forbids a stage; ConfigError if every cut has one. Ties go to the cut whose first stages
    are shortest, or, ``later_lighter``, longest (its later stages lighter: ``auto_balance``'s).
    """
    if not 1 <= split_size <= num_layers:
        raise ConfigError("split_size", f"cannot cut {num_layers} layers into {split_size} stages; "
                          f"use split_size between 1 and {num_layers}")
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(split_size + 1)]   # best[k][i]: k stages of the first i layers
    cut = [[0] * (num_layers + 1) for _ in range(split_size + 1)]
    best[0][0] = 0.0
    for k in range(1, split_size + 1):
        for i in range(k, num_layers - (split_size - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], cost(k - 1, j, i))
                if value < best[k][i] or (later_lighter and value == best[k][i]):
                    best[k][i], cut[k][i] = value, j
    if best[split_size][num_layers] == inf:
        raise ConfigError("balance", f"no cut of {num_layers} layers into {split_size} stages "
                          f"is allowed; give balance explicitly")
    return counts_from_cuts(cut, split_size, num_layers)


def counts_from_cuts(cut: list[list[int]], split_size: int, num_layers: int) -> tuple[int, ...]:
    """Layers per stage, read back from a partition program's ``cut[k][i]`` (where stage k
    starts when k stages hold the first i layers)."""
    counts, i = [], num_layers
    for k in range(split_size, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return tuple(reversed(counts))


def draws_in_training(layers: Sequence[nn.Module]) -> list[bool]:
    """Whether each layer draws random numbers in training (a dropout or a stochastic depth of nonzero rate)."""
    return [any(module_draws(module) for module in layer.modules()) for layer in layers]


def module_draws(module: nn.Module) -> bool:
    """Whether ``module`` itself draws in training: an ``nn.Dropout*`` with p > 0, timm's ``DropPath`` with
    drop_prob > 0."""
    rate = getattr(module, "p", 0.0) if isinstance(module, nn.modules.dropout._DropoutNd) else (
        getattr(module, "drop_prob", 0.0) if type(module).__name__ == "DropPath" else 0.0)
    return isinstance(rate, (int, float)) and rate > 0


def no_fitting_cut(layers: Sequence[nn.Module], cfg: ParallelConfig, reach: TileReach,
                   memory: Sequence[LayerMemory] | None) -> ConfigError:
    """The refusal when no cut fits the tiles: the first layer that does not fit, then what would:
    a larger image size (with the default cut there) or fewer spatial parts at this size."""
    height, width = reach.image_size
    rows, cols = reach.grid
    why = reach.refusal.detail if reach.refusal is not None else "it does not fit"
    found = (larger_image_that_fits(layers, cfg, reach, memory), fewer_parts_that_fit(layers, cfg, reach, memory))
    ways = [way for way in found if way is not None] or ["use fewer spatial parts or a larger image size"]
    return ConfigError("image_size", f"no stage cut of the {len(layers)} layers fits {rows}x{cols} tiles of a "
                       f"{height}x{width} image: the spatial stages need {cfg.spatial_size} layer(s) "
                       f"from the start and layer {reach.layers} does not fit ({why}); "
                       + "; or ".join(ways))


def larger_image_that_fits(layers: Sequence[nn.Module], cfg: ParallelConfig, reach: TileReach,
                           memory: Sequence[LayerMemory] | None) -> str | None:
    """``--image-size N fits (there the default cut is --balance ...)`` for the smallest of ``larger_sizes``
    at which a cut fits, or None."""
    num = len(layers)
    for larger in tile_reaches(layers, reach.grid, larger_sizes(reach.image_size), max_spatial_layers(num, cfg)):
        cut = None if larger.unknown else fitting_cut(cfg, num, memory, larger.limit)
        if cut is not None:
            height, width = larger.image_size
            side = str(height) if height == width else f"{height}x{width}"
            return f"--image-size {side} fits (there the default cut is --balance {','.join(map(str, cut))})"
    return None


def fewer_parts_that_fit(layers: Sequence[nn.Module], cfg: ParallelConfig, reach: TileReach,
                         memory: Sequence[LayerMemory] | None) -> str | None:
    """``--num-spatial-parts N fits this image size`` for the largest of ``fewer_parts`` at which a cut fits,
    or None."""
    num = len(layers)
    for parts in fewer_parts(cfg):
        try:
            smaller = cfg.with_(num_spatial_parts=parts)
        except ConfigError:
            continue
        found = tile_reach(layers, smaller, reach.image_size, limit=max_spatial_layers(num, cfg))
        if found is not None and not found.unknown and fitting_cut(smaller, num, memory, found.limit) is not None:
            return f"--num-spatial-parts {parts} fits this image size"
    return None


def larger_sizes(image_size: tuple[int, int], count: int = 48) -> list[tuple[int, int]]:
    """Candidate image sizes above ``image_size``, smallest first: steps of the largest power of two
    (at most 32) dividing both sides, so a model's downsampling still divides them, then doublings."""
    height, width = image_size
    step = 1
    while step < 32 and height % (2 * step) == 0 and width % (2 * step) == 0:
        step *= 2
    found = [(height + k * step, width + k * step) for k in range(1, count + 1)]
    scale = 2
    while found[-1][0] < 16 * height:
        found.append((height * scale, width * scale))
        scale *= 2
    return sorted(set(s for s in found if s[0] > height or s[1] > width))


def fewer_parts(cfg: ParallelConfig) -> list[int]:
    """Smaller tile counts of ``cfg``'s slice method, largest first (square: perfect squares)."""
    if cfg.grid is not None:
        return []
    square = cfg.slice_method is SliceMethod.SQUARE
    return [p for p in range(cfg.num_spatial_parts - 1, 1, -1) if not square or math.isqrt(p) ** 2 == p]


def auto_balance(layers: Sequence[nn.Module], sample: Payload, split_size: int,
                 by: str = "time", repeats: int = 3) -> tuple[int, ...]:
    """A balance for ``split_size`` stages from profiling each layer ``by`` 'time' or 'memory' (``layer_probe``):
    the cut minimising the largest stage's sum, ties to the cut whose later stages are lighter."""
    profilers: dict[str, Callable[[], Sequence[float]]] = {
        "time": lambda: profile_layer_times(layers, sample, repeats),
        "memory": lambda: profile_layer_memory(layers, sample),
    }
    if by not in profilers:
        raise ValueError(f"auto_balance by={by!r}: use 'time' or 'memory'")
    prefix = list(accumulate((float(c) for c in profilers[by]()), initial=0.0))
    return partition_stages(len(prefix) - 1, split_size, lambda stage, start, stop: prefix[stop] - prefix[start],
                            later_lighter=True)
