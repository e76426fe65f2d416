"""The attention exchanges of a spatial stage as the conversion families cost them: bytes per tile, one sample.

Every module of the stage's layers that a conversion family (``spatial.families``) with a cost model matches is costed
by that family (``Family.cost``: Swin's window gathers and patch merges, MaxViT's partition moves, LiteMLA's
all-reduce, a ViT's ring attention), on the token grid its input has in one process (found by one forward of the
layers on ``meta``); the module's children are left to it. What the families do not model (a convolution's halo) the
footprint's simulated tiles count (``tile_footprints.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..config import ConfigError, ParallelConfig
from ..models.vit import TokenEmbedding, patch_grid_of
from ..pipeline.default_cut import default_balance
from ..spatial.cost import ExchangeBytes
from ..spatial.families import Family, family_of
from ..spatial.fit import meta_copy
from ..spatial.geometry import TileGrid


@dataclass(frozen=True)
class Exchange:
    """One costed module: its ``path`` in the stage (``<layer>.<path>``), its family's name, the token grid of its
    input, and the busiest tile's ``traffic``."""

    path: str
    family: str
    sizes: tuple[int, ...]
    traffic: ExchangeBytes


@dataclass(frozen=True)
class StageExchanges:
    """The costed modules of a spatial stage; the sums are per tile, one sample, forward (the backward sends as much
    again); ``held``: the largest buffer one exchange fills."""

    exchanges: tuple[Exchange, ...]

    @property
    def sent(self) -> int:
        return sum(e.traffic.sent for e in self.exchanges)

    @property
    def received(self) -> int:
        return sum(e.traffic.received for e in self.exchanges)

    @property
    def held(self) -> int:
        return max((e.traffic.held for e in self.exchanges), default=0)

    def describe(self) -> str:
        """One line: how many exchanges, and their bytes per tile."""
        if not self.exchanges:
            return "no attention exchanges"
        families = sorted({e.family.split(" (")[0] for e in self.exchanges})
        count = len(self.exchanges)
        return (f"{count} attention exchange{'' if count == 1 else 's'} ({', '.join(families)}): per tile and "
                f"sample, forward "
                f"{self.sent / 2**20:.3f} MiB sent, {self.received / 2**20:.3f} MiB received (backward as much "
                f"again), {self.held / 2**20:.3f} MiB held at most")


def costed_modules(layer: nn.Module, prefix: str) -> list[tuple[str, nn.Module, Family]]:
    """The outermost modules of ``layer`` a family with a cost model matches, with their paths."""
    found: list[tuple[str, nn.Module, Family]] = []

    def visit(module: nn.Module, path: str) -> None:
        family = family_of(module)
        if family is not None and family.cost is not None:
            found.append((path, module, family))
            return
        for name, child in module.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(layer, prefix)
    return found


def token_sizes(module: nn.Module, shape: Sequence[int], patch_grid: tuple[int, int] | None) -> tuple[int, ...] | None:
    """The token (or pixel) grid of ``module``'s input of ``shape``: a token sequence's patch grid (``patch_grid``),
    a map's two spatial axes (channels-first when the module starts with a convolution or a 2-D norm, else
    channels-last when its last axis is the module's width); None when it cannot be told."""
    if len(shape) == 3:
        return patch_grid
    if len(shape) != 4:
        return None
    first = next((m for m in module.modules() if any(True for _ in m.parameters(recurse=False))), None)
    width = getattr(module, "dim", None)
    if not isinstance(width, int):
        norm = getattr(first, "normalized_shape", None)
        width = int(norm[0]) if norm else None
    channels_first = isinstance(first, nn.modules.conv._ConvNd) or type(first).__name__.endswith("2d")
    if not channels_first and width == shape[-1]:
        return (int(shape[1]), int(shape[2]))
    return (int(shape[2]), int(shape[3]))


def input_shapes(layers: Sequence[nn.Module], image: Sequence[int],
                 wanted: Sequence[nn.Module]) -> list[tuple[int, ...]]:
    """The input shape of each module of ``wanted`` (modules of ``layers``) in one forward of ``layers`` on an
    ``image`` (C, H, W) of one sample, on ``meta`` (copies: nothing computed, the originals untouched)."""
    net = nn.Sequential(*layers)
    names = {id(m): n for n, m in net.named_modules()}
    copy = meta_copy(net)
    found: dict[int, tuple[int, ...]] = {}
    handles: list[RemovableHandle] = []
    for index, module in enumerate(wanted):
        target = copy.get_submodule(names[id(module)])

        def record(_: nn.Module, args: tuple[object, ...], index: int = index) -> None:
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and index not in found:
                found[index] = tuple(first.shape)
        handles.append(target.register_forward_pre_hook(record))
    dtype = next((p.dtype for p in copy.parameters()), torch.float32)
    try:
        with torch.no_grad():
            copy.eval()(torch.empty(1, *image, device="meta", dtype=dtype))
    finally:
        for handle in handles:
            handle.remove()
    return [found.get(index, ()) for index in range(len(wanted))]


def stage_exchanges(layers: Sequence[nn.Module], grid: TileGrid, image_size: int | tuple[int, int],
                    in_channels: int = 3, element_bytes: int = 4, first_layer: int = 0) -> StageExchanges:
    """``StageExchanges`` of a spatial stage running ``layers`` (from the model's layer ``first_layer``, which takes
    ``image_size`` images) on ``grid``, ``element_bytes`` per value."""
    rows, cols = (image_size, image_size) if isinstance(image_size, int) else image_size
    costed = [(f"{first_layer + i}.{path}".rstrip("."), module, family)
              for i, layer in enumerate(layers) for path, module, family in costed_modules(layer, "")]
    if not costed:
        return StageExchanges(())
    shapes = input_shapes(layers, (in_channels, rows, cols), [module for _, module, _ in costed])
    patch_grid = patch_grid_of(layers[0]) if layers and isinstance(layers[0], TokenEmbedding) else None
    exchanges = []
    for (path, module, family), shape in zip(costed, shapes):
        sizes = token_sizes(module, shape, patch_grid)
        if sizes is None or family.cost is None:
            continue
        exchanges.append(Exchange(path, family.name, sizes, family.cost(module, grid, sizes, element_bytes)))
    return StageExchanges(tuple(exchanges))


def config_exchanges(layers: Sequence[nn.Module], cfg: ParallelConfig, image_size: int | tuple[int, int],
                     in_channels: int = 3, element_bytes: int = 4) -> StageExchanges | None:
    """``StageExchanges`` of ``cfg``'s first spatial stage on ``layers`` (the engine's cut at ``image_size``); None
    without a spatial stage or on a volume's grid."""
    if cfg.spatial_size == 0 or cfg.volume_grid is not None:
        return None
    balance = default_balance(layers, cfg, image_size=image_size, in_channels=in_channels)
    return stage_exchanges(layers[:balance[0]], TileGrid(*cfg.grid_shape), image_size, in_channels, element_bytes)


def layout_cost(layers: Sequence[nn.Module], cfg: ParallelConfig, image_size: int, in_channels: int = 3) -> str:
    """What ``layout --model`` adds below the stage cut: the memory model's peak per rank for one sample a step
    (``estimate_memory``) and the spatial stage's attention exchanges (``config_exchanges``), or why the planner
    cannot lay the configuration out."""
    from .memory import estimate_memory
    from .profile import profile_layers

    dtype = next((p.dtype for layer in layers for p in layer.parameters()), torch.float32)
    try:
        plan = estimate_memory(profile_layers(layers, image_size, in_channels), cfg, image_size, 1)
        exchanges = config_exchanges(layers, cfg, image_size, in_channels, dtype.itemsize)
    except (ConfigError, ValueError) as err:
        return f"cost: the planner cannot lay this configuration out: {err}"
    rank = plan.binding_rank
    lines = [f"cost (planner, batch 1): peak {plan.peak / 2**20:.1f} MiB on rank {rank.rank} ({rank.role})"]
    if exchanges is not None:
        lines.append(f"spatial stage 0: {exchanges.describe()}")
    return "\n".join(lines)
