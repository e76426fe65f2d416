"""Ring attention's key/value traffic on token tiles as the planner counts it: the ViT family's ``FamilyCost``."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from ..cost import ExchangeBytes
from ..geometry import TileGrid
from .ring_steps import RingSchedule, ring_traffic


def member_tokens(grid: TileGrid, sizes: Sequence[int]) -> tuple[int, ...]:
    """Tokens each tile of ``grid`` holds of a token grid of ``sizes`` (balanced ranges per axis), in ring order."""
    return tuple(math.prod(stop - start for start, stop in extent) for extent in grid.extents(sizes))


def ring_member_traffic(tokens: Sequence[int], member: int, width: int, element_bytes: int) -> ExchangeBytes:
    """One ring member's forward of one attention layer ``width`` wide (heads x head size), its ring's members
    holding ``tokens``: the key/value blocks it passes on, those it receives (its predecessor's sends), and the
    blocks in flight (its own packed block and the largest arriving one)."""
    counts = tuple(tokens)
    members = len(counts)
    if members == 1:
        return ExchangeBytes()
    key = width * element_bytes
    sent = ring_traffic(counts, member, key).forward
    received = ring_traffic(counts, RingSchedule(members, member).prev, key).forward
    arriving = max(counts[step.arriving] for step in RingSchedule(members, member).steps if step.arriving is not None)
    return ExchangeBytes(sent, received, 2 * key * (counts[member] + arriving))


def _width(module: nn.Module) -> int:
    """Attention width of a timm ``Attention``: heads x head size (its ``qkv`` makes three of it)."""
    heads, head_dim = getattr(module, "num_heads", None), getattr(module, "head_dim", None)
    if isinstance(heads, int) and isinstance(head_dim, int):
        return heads * head_dim
    qkv = getattr(module, "qkv", None)
    out = getattr(qkv, "out_features", None)
    if not isinstance(out, int):
        raise TypeError(f"{type(module).__name__}: no num_heads/head_dim or qkv projection to size its attention")
    return out // 3


def attention_ring_cost(module: nn.Module, grid: TileGrid, sizes: Sequence[int], element_bytes: int) -> ExchangeBytes:
    """``FamilyCost`` of a ViT's global attention on token tiles (``module``: timm's ``Attention``; ``sizes``: the
    patch grid, class and register tokens left out): ring attention's keys and values, the busiest member's (each
    figure the largest over the members)."""
    tokens = member_tokens(grid, sizes)
    width = _width(module)
    parts = [ring_member_traffic(tokens, member, width, element_bytes) for member in range(len(tokens))]
    return ExchangeBytes(max(p.sent for p in parts), max(p.received for p in parts), max(p.held for p in parts))
