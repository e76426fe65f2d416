"""SP -> LP hand-off: join a stage's output tiles into one tensor, split its gradient back."""

from __future__ import annotations

from collections.abc import Sequence
from types import EllipsisType

import torch

from ..comm.messages import Payload, as_items, like
from ..spatial.geometry import Range, TileGrid

Region = tuple[Range, ...]   # a tile's half-open range along every tiled axis, outermost first


def _is_tiled(t: object, grid: TileGrid) -> bool:
    """Whether ``t`` is a tile of a feature map: ``(N, C, *tiled)`` with one tiled dim per grid axis."""
    return isinstance(t, torch.Tensor) and t.dim() == 2 + grid.ndim


def _window(region: Region) -> tuple[EllipsisType | slice, ...]:
    """The index selecting ``region`` of a tensor's last ``len(region)`` dims."""
    return (Ellipsis, *(slice(start, stop) for start, stop in region))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tiles' copies of a replicated tensor agree (up to the rounding of an all-reduce's order)."""
    if a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    scale = float(b.detach().abs().max()) if b.numel() else 0.0
    return b.numel() == 0 or float((a.detach() - b.detach()).abs().max()) <= 1e-3 * scale + 1e-30


def input_tile(x: Payload, grid: TileGrid, tile: int, leading: int = 2) -> Payload:
    """Tile ``tile`` of a full input: every tensor of ``leading`` + ``grid.ndim`` dims or more is cut on its
    last ``grid.ndim`` (images (N, C, H, W) or volumes (N, C, D, H, W): ``leading=2``; masks (N, H, W) or
    label volumes (N, D, H, W): ``leading=1``)."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() < leading + grid.ndim:
            return t
        return t[_window(grid.extent(tile, t.shape[-grid.ndim:]))].contiguous()
    return like(x, [cut(t) for t in as_items(x)])


def boxes_from_tiles(shapes: Sequence[Sequence[int]], grid: TileGrid) -> tuple[list[Region], tuple[int, ...]]:
    """Tile regions and the full tiled lengths ((height, width), a volume's (depth, height, width)) from the
    tiles' shapes, checked against ownership."""
    lengths = grid.full_lengths(shapes)
    regions = grid.extents(lengths)
    shown = "x".join(map(str, lengths))
    for tile, (shape, region) in enumerate(zip(shapes, regions)):
        owned = tuple(stop - start for start, stop in region)
        if tuple(shape[-grid.ndim:]) != owned:
            raise ValueError(f"tile {tile} has spatial shape {tuple(shape[-grid.ndim:])} but owns "
                             f"{'x'.join(map(str, owned))} of a {shown} map: the spatial stage "
                             f"must output exactly the balanced tile split")
    return regions, lengths


def join_tiles(tiles: Sequence[Payload], grid: TileGrid) -> tuple[Payload, list[list[Region] | None]]:
    """One full payload from every tile's payload (tile order); also the boxes used.

    A 4-d (N, C, h, w) tensor (on a volume's grid a 5-d (N, C, d, h, w)) is a tile of a feature map; any
    other (a pooled (N, C) vector after a global pool on tiles) is replicated: the same on every tile, taken
    once (its boxes None), and its gradient goes whole to every tile (``split_grad``), the rule of a
    replicated result's consumer.
    """
    per_tile = [as_items(t) for t in tiles]
    joined: list[torch.Tensor] = []
    all_boxes: list[list[Region] | None] = []
    for position, first in enumerate(per_tile[0]):
        parts = [items[position] for items in per_tile]
        if not _is_tiled(first, grid):
            if any(not _same(part, first) for part in parts[1:]):
                raise ValueError(f"a spatial stage passes a {first.dim()}-d tensor that differs between its "
                                 f"tiles to the next stage; a tensor other than feature-map tiles must be "
                                 f"replicated (a global pool's result). Move the layer that makes it into a "
                                 f"layer-parallel stage (smaller spatial_size or another balance)")
            joined.append(first)
            all_boxes.append(None)
            continue
        boxes, lengths = boxes_from_tiles([p.shape for p in parts], grid)
        full = first.new_empty((*first.shape[:-grid.ndim], *lengths))
        for part, region in zip(parts, boxes):
            full[_window(region)] = part
        joined.append(full)
        all_boxes.append(boxes)
    return like(tiles[0], joined), all_boxes


def split_grad(grads: Sequence[torch.Tensor | None], boxes: Sequence[list[Region] | None],
               tile: int) -> list[torch.Tensor | None]:
    """Tile ``tile``'s part of the full-tensor gradients (None stays None)."""
    out = []
    for grad, tile_boxes in zip(grads, boxes):
        if grad is None or tile_boxes is None:
            out.append(grad)
            continue
        out.append(grad[_window(tile_boxes[tile])].contiguous())
    return out
