"""Token gathers across the tile group as autograd Functions, and the distributed cyclic roll of an N-axis tile.
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch

from ...comm.handles import Group, Transfer
from ...comm.protocol import Comm
from ...comm.tags import WINDOW
from ..function_ctx import FunctionContext
from .plan import TileGather, TokenBoxes, plan_roll

Moves = list[tuple[int, torch.Tensor]]   # (global rank, slot indices) per peer


class Direction(Enum):
    """Which way a gather's messages go (the gather, or its adjoint in backward), with its tag in WINDOW."""

    FORWARD = "forward"
    BACKWARD = "backward"

    @property
    def tag(self) -> int:
        return WINDOW.tag(list(Direction).index(self))


@dataclass(frozen=True)
class Route:
    """One direction of a gather on one device: ``size`` target slots, ``own_to[i]`` <- ``own_from[i]`` of the
    input, each peer's message sent from (``outgoing``) or received into (``incoming``) its slots, zeros elsewhere.

    ``pick`` (a copy route: no target slot named twice, and some named locally) names an input slot for EVERY target
    slot: the local part is one ``index_select`` (received slots overwritten later, ``blank`` ones zeroed) instead
    of zeros, a selection and a scatter; ``accumulate``: some target slot takes several values (the adjoint of a
    gather that reads one slot twice), which are added into zeros in message order."""

    size: int
    own_from: torch.Tensor
    own_to: torch.Tensor
    outgoing: Moves
    incoming: Moves
    accumulate: bool
    pick: torch.Tensor | None
    blank: torch.Tensor

    @classmethod
    def build(cls, size: int, own: tuple[Sequence[int], Sequence[int]], outgoing: Sequence[tuple[int, Sequence[int]]],
              incoming: Sequence[tuple[int, Sequence[int]]], device: torch.device) -> Route:
        """The route filling ``size`` slots: ``own`` (input slots, target slots), (rank, slots) per peer."""
        def index(slots: Sequence[int]) -> torch.Tensor:
            return torch.tensor(slots, dtype=torch.long, device=device)

        own_from, own_to = own
        named = list(own_to) + [slot for _, slots in incoming for slot in slots]
        accumulate = len(set(named)) < len(named)
        pick: list[int] | None = None
        if not accumulate and own_from:
            pick = [own_from[0]] * size          # any input slot where the value comes from elsewhere
            for source, target in zip(own_from, own_to):
                pick[target] = source
        blank = sorted(set(range(size)) - set(named)) if pick is not None else []
        return cls(size, index(own_from), index(own_to), [(rank, index(slots)) for rank, slots in outgoing],
                   [(rank, index(slots)) for rank, slots in incoming], accumulate,
                   None if pick is None else index(pick), index(blank))

    def local(self, values: torch.Tensor) -> torch.Tensor:
        """The ``(B, size, ...)`` result before any message: the local slots filled, zeros where nothing comes."""
        if self.pick is not None:
            out = values.index_select(1, self.pick)
            return out.index_fill_(1, self.blank, 0) if self.blank.numel() else out
        out = values.new_zeros((values.shape[0], self.size, *values.shape[2:]))
        if self.own_from.numel():
            self.place(out, self.own_to, values.index_select(1, self.own_from))
        return out

    def place(self, out: torch.Tensor, slots: torch.Tensor, part: torch.Tensor) -> None:
        """``part``'s tokens into ``out``'s ``slots``; an accumulating route adds them in a fixed order on every device:
        ``index_add_`` on CPU (serial), ``index_put_(accumulate=True)`` elsewhere (sorted by slot: CUDA's
        ``index_add_`` adds with atomics unless torch's deterministic algorithms are on)."""
        if not self.accumulate:
            out.index_copy_(1, slots, part)
        elif out.device.type == "cpu":
            out.index_add_(1, slots, part)
        else:
            out.transpose(0, 1).index_put_((slots,), part.transpose(0, 1), accumulate=True)

    def run(self, values: torch.Tensor, comm: Comm, via: Group | None, direction: Direction) -> torch.Tensor:
        """This route on ``values``: the exchange posted first, the local part built while messages travel; the
        wait for the messages is the tracer's ``window_wait`` span (``what``: the direction's name)."""
        tag = direction.tag
        transfers = [Transfer.to(values.index_select(1, slots), rank, tag) for rank, slots in self.outgoing]
        arrived = []
        for rank, slots in self.incoming:
            buffer = values.new_empty((values.shape[0], slots.numel(), *values.shape[2:]))
            transfers.append(Transfer.into(buffer, rank, tag))
            arrived.append((buffer, slots))
        pending = comm.exchange(transfers, via=via) if transfers else None
        out = self.local(values)
        if pending is not None:
            with comm.tracer.span("window_wait", what=direction.value):
                pending.wait()
        for buffer, slots in arrived:
            self.place(out, slots, buffer)
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
        self._routes: dict[torch.device, tuple[Route, Route]] = {}

    def routes(self, device: torch.device) -> tuple[Route, Route]:
        """The plan's forward and backward (adjoint) routes on ``device``, built once."""
        cached = self._routes.get(device)
        if cached is None:
            plan, ranks = self.plan, self.ranks
            sends = [(ranks[peer], slots) for peer, slots in plan.sends]
            receives = [(ranks[peer], slots) for peer, slots in plan.receives]
            cached = (Route.build(plan.size, (plan.own_sources, plan.own_targets), sends, receives, device),
                      Route.build(plan.source_size, (plan.own_targets, plan.own_sources), receives, sends, device))
            self._routes[device] = cached
        return cached

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(B, plan.source_size, ...)``; returns ``(B, plan.size, ...)``, differentiable."""
        if x.shape[1] != self.plan.source_size:
            raise ValueError(f"tile {self.plan.tile}: gather expects {self.plan.source_size} tokens in dim 1, "
                             f"got {tuple(x.shape)}")
        result: torch.Tensor = _TokenGather.apply(x.contiguous(), self)
        return result

    def forward_values(self, x: torch.Tensor) -> torch.Tensor:
        return self.routes(x.device)[0].run(x, self.comm, self.via, Direction.FORWARD)

    def backward_values(self, grad: torch.Tensor) -> torch.Tensor:
        return self.routes(grad.device)[1].run(grad, self.comm, self.via, Direction.BACKWARD)


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
