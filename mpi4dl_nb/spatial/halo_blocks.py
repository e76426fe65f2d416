"""Where every part of a tile widened by halo phases comes from: the owned tile, a received strip or padding.
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from types import EllipsisType

import torch

from .geometry import AxisExchange, Range, range_length

Spans = tuple[slice, ...]        # one slice per tiled axis (the tensor's last dims)
Index = tuple[EllipsisType | slice, ...]   # a tensor index: ``...`` then one slice per tiled axis
Sources = Sequence[torch.Tensor | None]   # [owned tile, strip 0, strip 1, ...] (None: not received)

OWN = 0   # the owned tile's index in ``Sources``; strip ``s`` is at ``1 + s``


@dataclass(frozen=True)
class Block:
    """A box of the region: ``target`` in the region, its values from ``Sources[source]`` at ``origin``, or
    the padding value (``source`` None)."""

    target: Spans
    source: int | None
    origin: Spans


def _span(r: Range, shift: int = 0) -> slice:
    return slice(r[0] - shift, r[1] - shift)


def _kept(plan: AxisExchange) -> tuple[slice, slice]:
    """(in the needed range, in the owned range) of the kept part along one axis."""
    return _span(plan.keep, plan.needed[0]), _span(plan.keep, plan.owned[0])


@lru_cache(maxsize=512)
def region_blocks(axes: tuple[AxisExchange, ...], upto: int, ranges: tuple[Range, ...] = ()) -> tuple[Block, ...]:
    """The blocks of the region widened along axes ``0..upto-1`` and spanning ``ranges`` (image coordinates,
    inside the owned range; default: the owned range) along the others; empty blocks left out."""
    ranges = ranges or tuple(plan.owned for plan in axes[upto:])
    rest_target = tuple(slice(0, range_length(r)) for r in ranges)
    rest_origin = tuple(_span(r, plan.owned[0]) for r, plan in zip(ranges, axes[upto:]))
    kept = [_kept(plan) for plan in axes[:upto]]
    found = [Block(tuple(k[0] for k in kept) + rest_target, OWN, tuple(k[1] for k in kept) + rest_origin)]
    for j, plan in enumerate(axes[:upto]):
        before = tuple(slice(0, p.needed_len) for p in axes[:j])
        later = tuple(k[0] for k in kept[j + 1:]), tuple(k[1] for k in kept[j + 1:])
        for r in ((plan.needed[0], plan.needed[0] + plan.pad_before), (plan.needed[1] - plan.pad_after,
                                                                        plan.needed[1])):
            found.append(Block(before + (_span(r, plan.needed[0]),) + later[0] + rest_target, None, ()))
        for slot, r in ((2 * j, plan.recv_prev), (2 * j + 1, plan.recv_next)):
            found.append(Block(before + (_span(r, plan.needed[0]),) + later[0] + rest_target, 1 + slot,
                               before + (slice(0, range_length(r)),) + later[1] + rest_origin))
    return tuple(b for b in found if all(s.stop > s.start for s in b.target))


def region_shape(axes: Sequence[AxisExchange], upto: int, ranges: Sequence[Range] = ()) -> tuple[int, ...]:
    """The tiled lengths of the region ``region_blocks(axes, upto, ranges)`` covers."""
    ranges = ranges or [plan.owned for plan in axes[upto:]]
    return tuple(p.needed_len for p in axes[:upto]) + tuple(range_length(r) for r in ranges)


def strip_shape(axes: Sequence[AxisExchange], k: int, received: Range) -> tuple[int, ...]:
    """The tiled lengths of a strip of phase ``k`` whose range along axis ``k`` is ``received``."""
    return region_shape(axes, k, (received, *[p.owned for p in axes[k + 1:]]))


def at(spans: Spans) -> Index:
    """The index of ``spans`` in a tensor whose last dims are the tiled axes."""
    return (Ellipsis, *spans)


def fill_blocks(target: torch.Tensor, blocks: Sequence[Block], sources: Sources, pad_value: float) -> torch.Tensor:
    """Lay ``blocks`` into ``target`` from ``sources`` (padding: ``pad_value``); returns ``target``."""
    for block in blocks:
        if block.source is None:
            target[at(block.target)] = pad_value
        else:
            source = sources[block.source]
            assert source is not None, "a block reads a strip that was not received"
            target[at(block.target)] = source[at(block.origin)]
    return target


def scatter_blocks(grad: torch.Tensor, blocks: Sequence[Block], targets: Sources, accumulate: bool = True) -> None:
    """Adjoint of ``fill_blocks``: add ``grad`` of every block into its source's gradient in ``targets`` (padding:
    nowhere; ``accumulate=False`` copies instead, where every source is read by one block). A block whose
    target gradient is None is skipped (its gradient is not wanted)."""
    for block in blocks:
        if block.source is not None:
            target = targets[block.source]
            if target is not None:
                part = target[at(block.origin)]
                if accumulate:
                    part.add_(grad[at(block.target)])
                else:
                    part.copy_(grad[at(block.target)])
