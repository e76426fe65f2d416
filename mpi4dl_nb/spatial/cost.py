"""What a family of tile layers costs the planner: the bytes one tile exchanges for one module of the family."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


# the cost model of a conversion family: (``module``, of the family, before conversion; the ``grid``; its input's token
# or pixel grid ``sizes``, one per tiled axis; ``element_bytes`` per value) -> the busiest tile's exchange
FamilyCost = Callable[[nn.Module, TileGrid, Sequence[int], int], ExchangeBytes]
