"""What a family of tile layers costs the planner: the bytes one tile exchanges for one module of the family."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from .geometry import TileGrid


@dataclass(frozen=True)
class ExchangeBytes:
    """The busiest tile's exchange for one module, one sample, forward (bytes; the backward sends what the forward
    received and receives what it sent): ``sent``, ``received``, and ``held``: the buffers the exchange fills on
    the tile beside its own activations."""

    sent: int = 0
    received: int = 0
    held: int = 0


class FamilyCost(Protocol):
    """The cost model of a conversion family: ``module`` (of the family, before conversion) on ``grid``, its input's
    token (or pixel) grid ``sizes`` (one per tiled axis), ``element_bytes`` per value."""

    def __call__(self, module: nn.Module, grid: TileGrid, sizes: Sequence[int],
                 element_bytes: int) -> ExchangeBytes: ...
