"""SP -> LP hand-off: join a stage's output tiles into one tensor (a ViT's token tiles into its token sequence),
split its gradient back.

The runtime takes either through one seam: a ``TileJoin`` (``FeatureTiles``: feature-map tiles by their shapes;
``TokenTiling``: a ViT's token tiles) joins the tiles into a ``JoinedTiles``, the payload and how its gradient
splits back per tile. ``handoff_of`` picks the one a model's layers need.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import EllipsisType
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ..comm.messages import Payload, as_items, like
from ..spatial.geometry import Range, TileGrid

Region = tuple[Range, ...]   # a tile's half-open range along every tiled axis, outermost first


def _is_tiled(t: object, grid: TileGrid) -> bool:
    """Whether ``t`` is a tile of a feature map: ``(N, C, *tiled)`` with one tiled dim per grid axis."""
    return isinstance(t, torch.Tensor) and t.dim() == 2 + grid.ndim


def _window(region: Region) -> tuple[EllipsisType | slice, ...]:
    """The index selecting ``region`` of a tensor's last ``len(region)`` dims."""
    return (Ellipsis, *(slice(start, stop) for start, stop in region))


def _differs(copy: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor (no read): whether a tile's copy of a replicated tensor differs from tile 0's beyond the
    rounding of an all-reduce's order."""
    if not reference.is_floating_point():
        return (copy != reference).any()
    copy, reference = copy.detach(), reference.detach()
    return (copy - reference).abs().amax() > 1e-3 * reference.abs().amax() + 1e-30


def _first_differing(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int | None:
    """Index of the first (copy, tile 0's) pair of a replicated tensor that disagree, else None: one fused
    comparison and one read for the whole hand-off, not one per tensor."""
    if any(copy.shape != reference.shape for copy, reference in pairs):
        return next(i for i, (copy, reference) in enumerate(pairs) if copy.shape != reference.shape)
    checked = [i for i, (_, reference) in enumerate(pairs) if reference.numel()]
    if not checked:
        return None
    differs = torch.stack([_differs(*pairs[i]) for i in checked]).tolist()
    return next((i for i, bad in zip(checked, differs) if bad), None)


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
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []     # (a tile's copy, tile 0's) of replicated tensors
    for position, first in enumerate(per_tile[0]):
        parts = [items[position] for items in per_tile]
        if not _is_tiled(first, grid):
            copies += [(part, first) for part in parts[1:]]
            joined.append(first)
            all_boxes.append(None)
            continue
        boxes, lengths = boxes_from_tiles([p.shape for p in parts], grid)
        full = first.new_empty((*first.shape[:-grid.ndim], *lengths))
        for part, region in zip(parts, boxes):
            full[_window(region)] = part
        joined.append(full)
        all_boxes.append(boxes)
    differing = _first_differing(copies)
    if differing is not None:
        raise ValueError(f"a spatial stage passes a {copies[differing][1].dim()}-d tensor that differs between its "
                         f"tiles to the next stage; a tensor other than feature-map tiles must be replicated (a "
                         f"global pool's result). Move the layer that makes it into a layer-parallel stage (smaller "
                         f"spatial_size or another balance)")
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


class JoinedTiles(Protocol):
    """A hand-off's joined payload, and how its gradient splits back to each tile."""

    @property
    def payload(self) -> Payload: ...

    def tile_grads(self, grads: Sequence[torch.Tensor | None], tile: int) -> list[torch.Tensor | None]:
        """Tile ``tile``'s part of the joined payload's gradients (None stays None)."""
        ...


class TileJoin(Protocol):
    """How a spatial stage's output tiles join into the next (layer) stage's input."""

    def join_payloads(self, tiles: Sequence[Payload]) -> JoinedTiles:
        """One payload from every tile's (tile order)."""
        ...


@dataclass(frozen=True)
class JoinedFeatures:
    """Feature-map tiles joined by ``join_tiles``: the payload and the boxes it used."""

    payload: Payload
    boxes: list[list[Region] | None]

    def tile_grads(self, grads: Sequence[torch.Tensor | None], tile: int) -> list[torch.Tensor | None]:
        return split_grad(grads, self.boxes, tile)


@dataclass(frozen=True)
class FeatureTiles:
    """The hand-off of feature-map tiles (``join_tiles``/``split_grad``): a CNN's spatial stage."""

    grid: TileGrid

    def join_payloads(self, tiles: Sequence[Payload]) -> JoinedFeatures:
        return JoinedFeatures(*join_tiles(tiles, self.grid))


@dataclass(frozen=True)
class JoinedTokens:
    """Token tiles joined into the model's sequence by a ``TokenTiling``."""

    payload: torch.Tensor
    tiling: TokenTiling

    def tile_grads(self, grads: Sequence[torch.Tensor | None], tile: int) -> list[torch.Tensor | None]:
        return [None if grad is None else self.tiling.split(grad, tile) for grad in grads]


@dataclass(frozen=True)
class TokenTiling:
    """Where a ViT's tokens lie on the tiles of a spatial stage (the token-tile representation of
    ``spatial/tokens/tiles.py``): tile ``t`` holds the tokens of its box of the global ``token_grid`` (the balanced
    split, row-major in the box), tile 0 the ``num_prefix`` class/register tokens in front of its own. The
    global order a layer stage takes is the model's: prefix tokens, then the grid row-major."""

    grid: TileGrid
    token_grid: tuple[int, int]
    num_prefix: int

    def counts(self) -> list[int]:
        """Tokens each tile holds, in tile order."""
        return [(r1 - r0) * (c1 - c0) + (self.num_prefix if tile == 0 else 0)
                for tile, (r0, r1, c0, c1) in enumerate(self.grid.tile_boxes(*self.token_grid))]

    def check(self, shapes: Sequence[Sequence[int]]) -> None:
        """ValueError unless every tile's ``(N, n, C)`` holds exactly its share of the tokens."""
        held = [int(shape[-2]) for shape in shapes]
        if held != self.counts():
            raise ValueError(f"the spatial stage's token tiles hold {held} tokens; a {self.token_grid} token grid "
                             f"with {self.num_prefix} prefix tokens on {self.grid} tiles gives {self.counts()}")

    def join(self, tiles: Sequence[torch.Tensor]) -> torch.Tensor:
        """Every tile's tokens ``(N, n_t, C)`` as the model's whole sequence ``(N, prefix + rows * cols, C)``."""
        self.check([t.shape for t in tiles])
        first, (rows, cols) = tiles[0], self.token_grid
        batch, channels = first.shape[0], first.shape[-1]
        full = first.new_empty((batch, self.num_prefix + rows * cols, channels))
        full[:, :self.num_prefix] = first[:, :self.num_prefix]
        image = full[:, self.num_prefix:].view(batch, rows, cols, channels)
        for tile, (r0, r1, c0, c1) in enumerate(self.grid.tile_boxes(rows, cols)):
            own = tiles[tile][:, self.num_prefix if tile == 0 else 0:]
            image[:, r0:r1, c0:c1] = own.reshape(batch, r1 - r0, c1 - c0, channels)
        return full

    def split(self, grad: torch.Tensor, tile: int) -> torch.Tensor:
        """Tile ``tile``'s part ``(N, n_t, C)`` of the whole sequence's gradient (the adjoint of ``join``)."""
        rows, cols = self.token_grid
        batch, channels = grad.shape[0], grad.shape[-1]
        r0, r1, c0, c1 = self.grid.tile_box(tile, rows, cols)
        image = grad[:, self.num_prefix:].reshape(batch, rows, cols, channels)[:, r0:r1, c0:c1]
        own = image.reshape(batch, (r1 - r0) * (c1 - c0), channels)
        return torch.cat([grad[:, :self.num_prefix], own], dim=1) if tile == 0 else own.contiguous()

    def join_payloads(self, tiles: Sequence[Payload]) -> JoinedTokens:
        """``join`` as the runtime's hand-off (each tile's payload one token tensor)."""
        tensors = [t for t in tiles if isinstance(t, torch.Tensor) and t.dim() == 3]
        if len(tensors) != len(tiles):
            raise ValueError("a ViT's spatial stage passes one (N, n, C) token tensor per tile to the next stage; "
                             "end the spatial stage after the embedding or a block")
        return JoinedTokens(self.join(tensors), self)


@runtime_checkable
class TokenSource(Protocol):
    """A layer whose output is a ViT's tokens: on a spatial stage, token tiles laid out by its ``token_tiling``
    (``models/vit.TokenEmbedding``)."""

    def token_tiling(self, grid: TileGrid) -> TokenTiling: ...


def handoff_of(spatial_layers: Sequence[nn.Module], grid: TileGrid | None) -> TileJoin | None:
    """The hand-off after the spatial stages holding ``spatial_layers`` on ``grid``: token tiles when a layer there
    makes tokens, else feature-map tiles (None: no spatial stage)."""
    if grid is None:
        return None
    for layer in spatial_layers:
        if isinstance(layer, TokenSource):
            return layer.token_tiling(grid)
    return FeatureTiles(grid)
