"""Tile fit: how many leading layers of a list a spatial stage can hold at an image size (shape-only halos).

A layer fits the tiles when every conv and pool in it finds its halo on the adjacent tile
(``spatial.fit.halo_checked``: the pure halo geometry planned on ``meta`` tensors, nothing
allocated). Whether a layer fits depends only on its input's size and the grid, not on the
stage cut, and every spatial stage is cut on the same grid, so the spatial stages may hold
layers ``0 .. reach-1``: the cut search (``default_cut.default_balance``) asks ``tile_reach`` once and
forbids any spatial stage that ends past the first layer that does not fit.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from types import TracebackType

import torch
from torch import nn

from ..comm.messages import Payload
from ..config import ParallelConfig
from ..errors import ConfigError
from ..spatial.fit import halo_checked
from ..spatial.geometry import TileGrid
from .layer_memo import LayerMemo
from .layer_probe import PROBE_ERRORS, first_layer_channels, parameter_dtype

_REACHED: LayerMemo[TileReach] = LayerMemo()   # tile_reach's answers for the last few models


@dataclass(frozen=True)
class TileReach:
    """Which leading layers fit the tiles of ``grid`` on an ``image_size`` input.

    ``layers``: layers ``0 .. layers-1`` fit; ``refusal``: why layer ``layers`` does not (None:
    every layer scanned fits, or, ``unknown``, the scan stopped at a layer that cannot run
    shape-only at this size: what follows is not known, and not held against the cut).
    ``limit``: how many leading layers the spatial stages may hold (all when nothing refused).
    """

    image_size: tuple[int, int]
    grid: tuple[int, int]
    layers: int
    limit: int
    refusal: ConfigError | None = None
    unknown: bool = False


def tile_reach(layers: Sequence[nn.Module], cfg: ParallelConfig, image_size: int | tuple[int, int],
               limit: int | None = None, in_channels: int | None = None) -> TileReach | None:
    """How far the tiles of ``cfg``'s grid reach into ``layers`` at ``image_size``: ``ReachProbe(...).reach`` of
    the first ``limit`` layers (all if None), asked once (None: the input channels, ``in_channels`` if given,
    cannot be told). The answers for the last few models are kept (``layer_memo``)."""
    return _reached_once(layers, cfg, image_size, limit, in_channels)


def tile_reaches(layers: Sequence[nn.Module], grid: tuple[int, int], sizes: Sequence[tuple[int, int]],
                 limit: int) -> Iterator[TileReach]:
    """``tile_reach`` of ``layers`` on ``grid`` at each of ``sizes`` in turn, the meta copies made once (none:
    the input channels cannot be told)."""
    channels = first_layer_channels(layers)
    if channels is None:
        return
    with ReachProbe(layers, TileGrid(*grid), channels, parameter_dtype(layers)) as probe:
        for size in sizes:
            yield probe.reach(*size, limit=limit)


class ReachProbe:
    """Meta copies of the layers with halo checks, reused for any image size (a context manager).

    ``reach(height, width)`` runs the copies in order on a shape-only input of that size and
    stops at the first layer whose halo is wider than a tile.
    """

    def __init__(self, layers: Sequence[nn.Module], grid: TileGrid, in_channels: int,
                 dtype: torch.dtype = torch.float32) -> None:
        self.layers = list(layers)
        self.grid = grid
        self.in_channels = in_channels
        self.dtype = dtype
        self._stack = ExitStack()
        self._probes: list[nn.Module] = []

    def __enter__(self) -> ReachProbe:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stack.close()
        self._probes.clear()

    def _probe(self, index: int) -> nn.Module:
        while len(self._probes) <= index:
            at = len(self._probes)

            def label(name: str, at: int = at) -> str:   # the layer's index in the whole list
                return f"{at}.{name}" if name else str(at)
            self._probes.append(self._stack.enter_context(halo_checked(self.layers[at], self.grid, label)))
        return self._probes[index]

    def reach(self, height: int, width: int, limit: int | None = None) -> TileReach:
        """The fit of the first ``limit`` layers (all if None) on a ``height`` x ``width`` image."""
        count = len(self.layers) if limit is None else min(limit, len(self.layers))
        x: Payload = torch.empty(1, self.in_channels, height, width, dtype=self.dtype, device="meta")
        shape = ((height, width), (self.grid.rows, self.grid.cols))
        with torch.no_grad():
            for index in range(count):
                try:
                    x = self._probe(index)(x)
                except ConfigError as refusal:
                    return TileReach(*shape, index, index, refusal)
                except PROBE_ERRORS:
                    return TileReach(*shape, index, len(self.layers), unknown=True)
        return TileReach(*shape, count, len(self.layers))


def _reached_once(layers: Sequence[nn.Module], cfg: ParallelConfig, image_size: int | tuple[int, int],
                  limit: int | None, in_channels: int | None) -> TileReach | None:
    grid = TileGrid(*cfg.grid_shape)
    channels = first_layer_channels(layers) if in_channels is None else in_channels
    if channels is None:
        return None
    height, width = (image_size, image_size) if isinstance(image_size, int) else map(int, image_size)

    def scan() -> TileReach:
        with ReachProbe(layers, grid, channels, parameter_dtype(layers)) as probe:
            return probe.reach(height, width, limit)
    return _REACHED.get(layers, (grid.shape, height, width, limit, channels), scan)
