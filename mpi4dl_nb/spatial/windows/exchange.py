"""Token gathers across the tile group as autograd Functions, and the distributed cyclic roll of an N-axis tile.

``TokenExchange`` runs one tile's ``windows.TileGather`` on a ``(B, n, ...)`` tensor of tokens (the slots of the
plan in dim 1): its own slots copied, every peer's sent and received in one exchange (``Comm.exchange``: the mpi
plane or torch.distributed, as halos), zeros where the plan names nothing. Backward is the exact adjoint: the
gradients of received slots travel back to their owners and are added into what they sent; padding slots give none.

``DistributedRoll`` is ``torch.roll(whole, shifts, dims=<the grid's axes>)`` on channels-last tiles
``(B, *box, C)`` (2-D or 3-D grids): each tile sends ``|shift|`` slabs to its neighbour along each shifted axis, the
grid's last tile to its first; backward rolls the gradient back the same way (the adjoint of a permutation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ...comm.handles import Group, Transfer
from ...comm.protocol import Comm
from ...comm.tags import WINDOW
from ..function_ctx import FunctionContext
from .plan import TileGather, TokenBoxes, plan_roll

Moves = list[tuple[int, torch.Tensor]]   # (global rank, slot indices) per peer


def _move(values: torch.Tensor, size: int, own_from: torch.Tensor, own_to: torch.Tensor, outgoing: Moves,
          incoming: Moves, comm: Comm, tag: int, accumulate: bool, via: Group | None = None) -> torch.Tensor:
    """A ``(B, size, ...)`` tensor: ``values[:, own_from]`` at ``own_to``, each peer's message at its slots (added
    in when ``accumulate``, the adjoint's case, where a slot may receive more than once), zeros elsewhere."""
    out = values.new_zeros((values.shape[0], size, *values.shape[2:]))
    place = out.index_add_ if accumulate else out.index_copy_
    if own_from.numel():
        place(1, own_to, values.index_select(1, own_from))
    transfers, arrived = [], []
    for rank, slots in outgoing:
        transfers.append(Transfer.to(values.index_select(1, slots).contiguous(), rank, tag))
    for rank, slots in incoming:
        buffer = values.new_empty((values.shape[0], slots.numel(), *values.shape[2:]))
        transfers.append(Transfer.into(buffer, rank, tag))
        arrived.append((buffer, slots))
    if transfers:
        comm.exchange(transfers, via=via).wait()
    for buffer, slots in arrived:
        place(1, slots, buffer)
    return out


class _TokenGatherCtx(FunctionContext, Protocol):
    exchange: TokenExchange


class _TokenGather(torch.autograd.Function):
    @staticmethod
    def forward(fctx: _TokenGatherCtx, x: torch.Tensor, exchange: TokenExchange) -> torch.Tensor:
        fctx.exchange = exchange
        return exchange.forward_values(x)

    @staticmethod
    def backward(fctx: _TokenGatherCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        return fctx.exchange.backward_values(grad.contiguous()), None


class TokenExchange:
    """One tile's gather (``plan``) among the tile group's global ``ranks`` (``ranks[t]`` holds tile ``t``); ``via``:
    the tile group, the route of its exchanges (None: the world)."""

    def __init__(self, plan: TileGather, comm: Comm, ranks: Sequence[int], via: Group | None = None) -> None:
        self.plan = plan
        self.comm = comm
        self.ranks = tuple(ranks)
        self.via = via
        self._indices: dict[torch.device, tuple[torch.Tensor, torch.Tensor, Moves, Moves]] = {}

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, Moves, Moves]:
        """The plan's index tensors on ``device``: own sources, own targets, sends, receives."""
        cached = self._indices.get(device)
        if cached is None:
            def index(slots: Sequence[int]) -> torch.Tensor:
                return torch.tensor(slots, dtype=torch.long, device=device)

            plan = self.plan
            cached = (index(plan.own_sources), index(plan.own_targets),
                      [(self.ranks[peer], index(slots)) for peer, slots in plan.sends],
                      [(self.ranks[peer], index(slots)) for peer, slots in plan.receives])
            self._indices[device] = cached
        return cached

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(B, plan.source_size, ...)``; returns ``(B, plan.size, ...)``, differentiable."""
        if x.shape[1] != self.plan.source_size:
            raise ValueError(f"tile {self.plan.tile}: gather expects {self.plan.source_size} tokens in dim 1, "
                             f"got {tuple(x.shape)}")
        result: torch.Tensor = _TokenGather.apply(x.contiguous(), self)
        return result

    def forward_values(self, x: torch.Tensor) -> torch.Tensor:
        own_from, own_to, sends, receives = self._on(x.device)
        return _move(x, self.plan.size, own_from, own_to, sends, receives, self.comm, WINDOW.tag(0), False,
                     self.via)

    def backward_values(self, grad: torch.Tensor) -> torch.Tensor:
        own_from, own_to, sends, receives = self._on(grad.device)
        return _move(grad, self.plan.source_size, own_to, own_from, receives, sends, self.comm, WINDOW.tag(1),
                     True, self.via)


class DistributedRoll:
    """``torch.roll(whole, shifts, dims=<grid axes>)`` of a channels-last tile ``(B, *box, C)`` of ``boxes``'s grid."""

    def __init__(self, boxes: TokenBoxes, shifts: Sequence[int], tile: int, comm: Comm, ranks: Sequence[int]) -> None:
        if len(shifts) != len(boxes.sizes):
            raise ValueError(f"one shift per axis of the {boxes.sizes} grid, got {tuple(shifts)}")
        self.boxes = boxes
        self.tile = tile
        self.shifts = tuple(int(s) for s in shifts)
        self.exchange = TokenExchange(plan_roll(boxes, self.shifts)[tile], comm, ranks)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lengths = self.boxes.lengths(self.tile)
        axes = len(lengths)
        if tuple(x.shape[1:1 + axes]) != lengths:
            raise ValueError(f"tile {self.tile} of the {self.boxes.sizes} grid is {lengths} (channels last), "
                             f"got {tuple(x.shape)}")
        flat = x.reshape(x.shape[0], -1, *x.shape[1 + axes:])
        return self.exchange(flat).reshape(x.shape)
