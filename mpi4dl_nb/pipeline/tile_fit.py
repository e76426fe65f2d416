"""Tile fit: how many leading layers of a list a spatial stage can hold at an image size (shape-only halos).

A layer fits the tiles when every conv and pool in it finds its halo on the adjacent tile
(``spatial.fit.halo_checked``: the pure halo geometry planned on ``meta`` tensors, nothing
allocated). Whether a layer fits depends only on its input's size and the grid, not on the
stage cut, and every spatial stage is cut on the same grid, so the spatial stages may hold
layers ``0 .. reach-1``: the cut search (``default_cut.default_balance``) forbids any spatial stage
that ends past the first layer that does not fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from types import TracebackType

import torch
from torch import nn

from ..comm.messages import Payload
from ..errors import ConfigError
from ..spatial.fit import halo_checked
from ..spatial.geometry import TileGrid
from .layer_memo import LayerMemo

PROBE_ERRORS = (RuntimeError, ValueError, TypeError, NotImplementedError)   # a layer that cannot run on meta
_REACHED: LayerMemo[SpatialReach] = LayerMemo()   # spatial_reach's answers for the last few models


def first_layer_channels(layers: Sequence[nn.Module]) -> int | None:
    """The channels the first layer takes (its first module with ``in_channels``), or None."""
    for module in layers[0].modules() if layers else ():
        channels = getattr(module, "in_channels", None)
        if isinstance(channels, int):
            return channels
    return None


def parameter_dtype(layers: Sequence[nn.Module]) -> torch.dtype:
    """The element type of the first parameter (float32 if there is none)."""
    return next((p.dtype for layer in layers for p in layer.parameters()), torch.float32)


@dataclass(frozen=True)
class SpatialReach:
    """Which leading layers fit the tiles of ``grid`` on an ``image_size`` input.

    ``layers``: layers ``0 .. layers-1`` fit; ``refusal``: why layer ``layers`` does not (None:
    every layer scanned fits, or, ``unknown``, the scan stopped at a layer that cannot run
    shape-only at this size: what follows is not known, and not held against the cut).
    """

    image_size: tuple[int, int]
    grid: tuple[int, int]
    layers: int
    refusal: ConfigError | None = None
    unknown: bool = False

    def limit(self, num_layers: int) -> int:
        """How many leading layers the spatial stages may hold (all when nothing refused)."""
        return self.layers if self.refusal is not None else num_layers


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

    def reach(self, height: int, width: int, limit: int | None = None) -> SpatialReach:
        """The fit of the first ``limit`` layers (all if None) on a ``height`` x ``width`` image."""
        count = len(self.layers) if limit is None else min(limit, len(self.layers))
        x: Payload = torch.empty(1, self.in_channels, height, width, dtype=self.dtype, device="meta")
        shape = ((height, width), (self.grid.rows, self.grid.cols))
        with torch.no_grad():
            for index in range(count):
                try:
                    x = self._probe(index)(x)
                except ConfigError as refusal:
                    return SpatialReach(*shape, index, refusal)
                except PROBE_ERRORS:
                    return SpatialReach(*shape, index, unknown=True)
        return SpatialReach(*shape, count)


def spatial_reach(layers: Sequence[nn.Module], grid: TileGrid, image_size: int | tuple[int, int],
                  limit: int | None = None, in_channels: int | None = None) -> SpatialReach | None:
    """``ReachProbe(...).reach`` of ``layers`` once (None: the input channels, ``in_channels`` if
    given, cannot be told). The answers for the last few models are kept (``layer_memo``)."""
    channels = first_layer_channels(layers) if in_channels is None else in_channels
    if channels is None:
        return None
    height, width = _pair(image_size)

    def scan() -> SpatialReach:
        with ReachProbe(layers, grid, channels, parameter_dtype(layers)) as probe:
            return probe.reach(height, width, limit)
    return _REACHED.get(layers, (grid.shape, height, width, limit, channels), scan)


def _pair(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
