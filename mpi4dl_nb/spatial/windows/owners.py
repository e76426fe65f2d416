"""MaxViT's windows of a token grid (blocks, strided grids), the tile that attends each one, and which tile's tokens
go to which window slot (``TokenMoves``; pure geometry on index tensors, no communication).

A *block* window of ``p0 x p1`` holds the tokens ``(i*p0 + a, j*p1 + b)``; a *grid* window of ``g0 x g1`` holds
the tokens ``(a*s0 + i, b*s1 + j)`` at the strides ``s = H/g`` across the whole grid (timm's ``window_partition``
and ``grid_partition``: window ``(i, j)``, position ``(a, b)`` in it, row-major). The windows form a lattice
(``H/p`` or ``H/g`` per axis) that the tile grid splits as it splits an image (balanced ranges): a tile attends
the windows of its part of the lattice, so each tile attends about 1/P of the windows (block windows inside a
tile stay there when the tile holds whole windows). A token goes to the tile attending its window and comes back
to the tile owning it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from ..geometry import TileGrid
from .plan import TileGather


class PartitionKind(Enum):
    """How windows take their tokens (timm's ``partition_type``)."""

    BLOCK = "block"
    GRID = "grid"


@dataclass(frozen=True)
class WindowPartition:
    """The windows of a ``tokens`` (H, W) grid: ``size`` is timm's ``partition_size`` (block or grid size)."""

    kind: PartitionKind
    size: tuple[int, int]
    tokens: tuple[int, int]

    def fits(self) -> bool:
        """Whether the grid splits into whole windows (timm asserts it)."""
        return all(n % p == 0 for n, p in zip(self.tokens, self.size))

    @property
    def lattice(self) -> tuple[int, int]:
        """The number of windows per axis."""
        return (self.tokens[0] // self.size[0], self.tokens[1] // self.size[1])

    @property
    def window(self) -> tuple[int, int]:
        """The window's shape (tokens per axis): the block, or the grid size."""
        return self.size

    def windows_of_tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """For every token of the grid ``(H, W)``: its window's lattice row and column, its row and column in it."""
        rows = torch.arange(self.tokens[0]).view(-1, 1).expand(self.tokens)
        cols = torch.arange(self.tokens[1]).view(1, -1).expand(self.tokens)
        if self.kind is PartitionKind.BLOCK:
            return rows // self.size[0], cols // self.size[1], rows % self.size[0], cols % self.size[1]
        strides = self.lattice
        return rows % strides[0], cols % strides[1], rows // strides[0], cols // strides[1]


def _tile_map(grid: TileGrid, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every cell of a ``height x width`` map: the tile owning it, and its row-major index in that tile."""
    owner = torch.empty(height, width, dtype=torch.long)
    local = torch.empty(height, width, dtype=torch.long)
    for tile, (r0, r1, c0, c1) in enumerate(grid.tile_boxes(height, width)):
        owner[r0:r1, c0:c1] = tile
        local[r0:r1, c0:c1] = torch.arange((r1 - r0) * (c1 - c0)).view(r1 - r0, c1 - c0)
    return owner, local


@dataclass(frozen=True)
class TokenMoves:
    """One tile's part of moving tokens between two layouts: ``take[t]`` are the indices (into this tile's
    ``size_in`` tokens) it sends to tile ``t``; ``put[t]`` the slots (of its ``size_out``) where what tile ``t``
    sends lands. Both sides list a pair's tokens in the same (global row-major) order."""

    tile: int
    take: dict[int, torch.Tensor]
    put: dict[int, torch.Tensor]
    size_in: int
    size_out: int

    def reversed(self) -> TokenMoves:
        """The way back: every token returns from its slot to where it came from."""
        return TokenMoves(self.tile, self.put, self.take, self.size_out, self.size_in)

    def gather(self) -> TileGather:
        """These moves as this tile's part of a gather (``exchange.TokenExchange`` runs it, exact adjoint)."""
        def slots(index: torch.Tensor | None) -> tuple[int, ...]:
            return () if index is None else tuple(int(i) for i in index.tolist())

        def peers(side: dict[int, torch.Tensor]) -> tuple[tuple[int, tuple[int, ...]], ...]:
            return tuple((t, slots(side[t])) for t in sorted(side) if t != self.tile and side[t].numel())

        return TileGather(self.tile, self.size_out, self.size_in, slots(self.put.get(self.tile)),
                          slots(self.take.get(self.tile)), peers(self.put), peers(self.take))


@dataclass(frozen=True)
class PartitionPlan:
    """A tile's windows of one partition: how many it attends and the token moves to them (``moves``)."""

    partition: WindowPartition
    windows_here: int
    moves: TokenMoves

    @property
    def area(self) -> int:
        return self.partition.window[0] * self.partition.window[1]


def partition_plan(partition: WindowPartition, grid: TileGrid, tile: int) -> PartitionPlan:
    """``tile``'s windows of ``partition`` on ``grid`` and the moves of every token to its window's tile."""
    lattice_owner, lattice_index = _tile_map(grid, *partition.lattice)
    token_owner, token_local = _tile_map(grid, *partition.tokens)
    wi, wj, a, b = partition.windows_of_tokens()
    area = partition.window[0] * partition.window[1]
    destination = lattice_owner[wi, wj].flatten()
    slot = (lattice_index[wi, wj] * area + a * partition.window[1] + b).flatten()
    source, local = token_owner.flatten(), token_local.flatten()
    mine_in, mine_out = source == tile, destination == tile
    take = {t: local[mine_in & (destination == t)] for t in range(grid.num_tiles)}
    put = {t: slot[mine_out & (source == t)] for t in range(grid.num_tiles)}
    windows_here = int((lattice_owner == tile).sum())
    return PartitionPlan(partition, windows_here,
                      TokenMoves(tile, take, put, int(mine_in.sum()), windows_here * area))
