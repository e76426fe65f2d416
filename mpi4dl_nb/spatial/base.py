"""Shared machinery of spatial layers: the per-model runtime and adopting a torch layer's state.

A spatial layer is a subclass of the torch layer it replaces, built around the *same*
parameter and buffer objects (so optimizers, state dicts and the serial model stay shared);
only ``forward`` differs. Tiles carry no global size, so the runtime learns each layer's
global input size once per image size (one small all-gather on the tile group at the first
call) and caches it; after that, a forward needs only halo messages and BatchNorm sums.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch
from torch import nn

from ..comm.handles import Group
from ..comm.protocol import Comm
from .geometry import LayerHalo, TileGrid
from .halo import HaloExchange
from .tiles import tile_ranks


class SpatialRuntime:
    """What every spatial layer of one spatialized model shares: grid, ranks, size cache."""

    def __init__(self, grid: TileGrid, ctx: Comm, group: Group | None = None,
                 image_size: tuple[int, int] | None = None) -> None:
        self.grid = grid
        self.ctx = ctx
        self.group = group
        self.ranks, self.tile = tile_ranks(grid, ctx, group)
        self.image_size: tuple[int, int] | None = None
        if image_size is not None:
            height, width = image_size
            self.image_size = (int(height), int(width))
        self.root_size: tuple[int, int] | None = None
        self._calls: dict[int, int] = {}
        self._sizes: dict[tuple[tuple[int, int], int, int], tuple[int, int]] = {}
        self.partial_parameters: list[nn.Parameter] = []

    # --------------------------------------------------------------- root hooks
    def begin_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Forward pre-hook of the spatialized root: learn the global input size."""
        self._calls.clear()
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            self.root_size = None
            return
        if self.image_size is not None:
            expected = self.grid.tile_of_size(self.tile, *self.image_size)
            if tuple(x.shape[-2:]) != expected:
                raise ValueError(f"spatialized model built for image_size {self.image_size}: "
                                 f"tile {self.tile} expects a {expected} tile, got "
                                 f"{tuple(x.shape[-2:])} (scatter inputs with dl.scatter_tiles)")
            self.root_size = self.image_size
        else:
            self.root_size = self.gather_size(x)

    def end_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.root_size = None

    # ----------------------------------------------------------------- sizes
    def gather_size(self, x: torch.Tensor) -> tuple[int, int]:
        """Global (H, W) of a tiled tensor from every tile's local size (one object gather)."""
        local = (int(x.shape[-2]), int(x.shape[-1]))
        if len(self.ranks) == 1:
            return local
        sizes = self.ctx.all_gather_object(local, group=self.group)
        grid = self.grid
        height, width = grid.full_size(sizes)
        for tile, size in enumerate(sizes):
            if tuple(size) != grid.tile_of_size(tile, height, width):
                raise ValueError(f"tile sizes {sizes} do not follow the balanced split of "
                                 f"{height}x{width} over {grid}; scatter inputs with "
                                 f"dl.scatter_tiles")
        return (height, width)

    def input_size(self, layer: object, x: torch.Tensor) -> tuple[int, int]:
        """Global input size of ``layer`` at this call (cached per image size and call order)."""
        if self.root_size is None:
            return self.gather_size(x)
        ordinal = self._calls.get(id(layer), 0)
        self._calls[id(layer)] = ordinal + 1
        key = (self.root_size, id(layer), ordinal)
        size = self._sizes.get(key)
        if size is None:
            size = self.gather_size(x)
            self._sizes[key] = size
        return size

    def exchange(self, geometry: LayerHalo, pad_value: float) -> HaloExchange:
        return HaloExchange(geometry, self.tile, self.ranks, self.ctx, pad_value)

    def __deepcopy__(self, memo: dict[int, Any]) -> SpatialRuntime:
        return self   # holds the communicator: never copied

    def __repr__(self) -> str:
        return f"SpatialRuntime({self.grid}, tile={self.tile}, ranks={self.ranks})"


M = TypeVar("M", bound=nn.Module)


def shallow_copy(module: nn.Module, cls: type[M]) -> M:
    """An instance of ``cls`` (``type(module)`` or a subclass) sharing ``module``'s state.

    Parameters, buffers and children are the same objects; the module's own dicts (of
    children, hooks, ...) are copied, so changes to the new module's dicts (a converted
    child, a new hook) do not touch the original.
    """
    new = cls.__new__(cls)
    new.__dict__.update({k: (type(v)(v) if isinstance(v, (dict, set)) else v)
                         for k, v in module.__dict__.items()})
    return new


def adopt(cls: type[M], module: nn.Module, runtime: SpatialRuntime, name: str) -> M:
    """``shallow_copy(module, cls)`` for a spatial layer class ``cls``, bound to ``runtime``."""
    new = shallow_copy(module, cls)
    object.__setattr__(new, "runtime", runtime)
    object.__setattr__(new, "layer_name", name or type(module).__name__)
    object.__setattr__(new, "_exchanges", {})
    return new


class SpatialLayer:
    """Mixin: cached halo exchange per global input size."""

    runtime: SpatialRuntime
    layer_name: str
    _exchanges: dict[Hashable, HaloExchange]

    def _halo(self, key: Hashable, build: Callable[[], HaloExchange]) -> HaloExchange:
        exchange = self._exchanges.get(key)
        if exchange is None:
            exchange = build()
            self._exchanges[key] = exchange
        return exchange
