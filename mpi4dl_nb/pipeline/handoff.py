"""SP -> LP hand-off: join a stage's output tiles into one tensor, split its gradient back."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comm.messages import Payload, as_items, like
from ..spatial.geometry import Box, TileGrid


def _is_tiled(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 4


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tiles' copies of a replicated tensor agree (up to the rounding of an all-reduce's order)."""
    if a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    scale = float(b.detach().abs().max()) if b.numel() else 0.0
    return b.numel() == 0 or float((a.detach() - b.detach()).abs().max()) <= 1e-3 * scale + 1e-30


def input_tile(x: Payload, grid: TileGrid, tile: int, min_dim: int = 4) -> Payload:
    """Tile ``tile`` of a full input: every tensor of ``min_dim`` dims or more (images (N, C, H, W); masks
    (N, H, W) with ``min_dim=3``) is cut on its last two."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() < min_dim:
            return t
        r0, r1, c0, c1 = grid.tile_box(tile, t.shape[-2], t.shape[-1])
        return t[..., r0:r1, c0:c1].contiguous()
    return like(x, [cut(t) for t in as_items(x)])


def boxes_from_tiles(shapes: Sequence[Sequence[int]], grid: TileGrid) -> tuple[list[Box], tuple[int, int]]:
    """Tile boxes and full (height, width) from the tiles' shapes, checked against ownership."""
    height, width = grid.full_size(shapes)
    boxes = grid.tile_boxes(height, width)
    for tile, (shape, (r0, r1, c0, c1)) in enumerate(zip(shapes, boxes)):
        if (shape[-2], shape[-1]) != (r1 - r0, c1 - c0):
            raise ValueError(f"tile {tile} has spatial shape {tuple(shape[-2:])} but owns "
                             f"{r1 - r0}x{c1 - c0} of a {height}x{width} map: the spatial stage "
                             f"must output exactly the balanced tile split")
    return boxes, (height, width)


def join_tiles(tiles: Sequence[Payload], grid: TileGrid) -> tuple[Payload, list[list[Box] | None]]:
    """One full payload from every tile's payload (tile order); also the boxes used.

    A 4-d (N, C, h, w) tensor is a tile of a feature map; any other (a pooled (N, C) vector after a global
    pool on tiles) is replicated: the same on every tile, taken once (its boxes None), and its gradient goes
    whole to every tile (``split_grad``), the rule of a replicated result's consumer.
    """
    per_tile = [as_items(t) for t in tiles]
    joined: list[torch.Tensor] = []
    all_boxes: list[list[Box] | None] = []
    for position, first in enumerate(per_tile[0]):
        parts = [items[position] for items in per_tile]
        if not _is_tiled(first):
            if any(not _same(part, first) for part in parts[1:]):
                raise ValueError(f"a spatial stage passes a {first.dim()}-d tensor that differs between its "
                                 f"tiles to the next stage; a tensor other than 4-d feature-map tiles must be "
                                 f"replicated (a global pool's result). Move the layer that makes it into a "
                                 f"layer-parallel stage (smaller spatial_size or another balance)")
            joined.append(first)
            all_boxes.append(None)
            continue
        boxes, (height, width) = boxes_from_tiles([p.shape for p in parts], grid)
        full = first.new_empty((*first.shape[:-2], height, width))
        for part, (r0, r1, c0, c1) in zip(parts, boxes):
            full[..., r0:r1, c0:c1] = part
        joined.append(full)
        all_boxes.append(boxes)
    return like(tiles[0], joined), all_boxes


def split_grad(grads: Sequence[torch.Tensor | None], boxes: Sequence[list[Box] | None],
               tile: int) -> list[torch.Tensor | None]:
    """Tile ``tile``'s part of the full-tensor gradients (None stays None)."""
    out = []
    for grad, tile_boxes in zip(grads, boxes):
        if grad is None or tile_boxes is None:
            out.append(grad)
            continue
        r0, r1, c0, c1 = tile_boxes[tile]
        out.append(grad[..., r0:r1, c0:c1].contiguous())
    return out
