"""Halo exchange along every tiled axis as an autograd Function whose backward is the exact adjoint.
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol, TypeVar

import torch

from ..comm.handles import Group, Request, Transfer
from ..comm.protocol import Comm
from ..comm.tags import HALO
from ..comm.trace import Stamp, Tracer
from .function_ctx import FunctionContext
from .geometry import AxisExchange, LayerHalo, Range, range_length
from .halo_blocks import OWN, fill_blocks, region_blocks, region_shape, scatter_blocks, strip_shape
from .replay import Strips, active_log

T = TypeVar("T")

PoolKey = tuple[str, tuple[int, ...], torch.dtype, torch.device]   # role, shape, dtype, device


class BufferPool:
    """Reusable contiguous staging buffers keyed by role, shape, dtype and device.

    At most ``max_entries`` buffers are kept (least recently used go first), so inputs of
    ever new shapes (a smaller last batch, other image sizes) do not pile buffers up.
    """

    def __init__(self, max_entries: int = 32) -> None:
        self.max_entries = max_entries
        self._buffers: OrderedDict[PoolKey, torch.Tensor] = OrderedDict()

    def get(self, role: str, shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        key: PoolKey = (role, tuple(shape), like.dtype, like.device)
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty(tuple(shape), dtype=like.dtype, device=like.device)
            self._buffers[key] = buf
            while len(self._buffers) > self.max_entries:
                self._buffers.popitem(last=False)
        else:
            self._buffers.move_to_end(key)
        return buf

    def clear(self) -> None:
        self._buffers.clear()

    @property
    def buffers(self) -> Mapping[PoolKey, torch.Tensor]:
        """Read-only view of the staging buffers by key (role, shape, dtype, device)."""
        return MappingProxyType(self._buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def neighbour_rank(peer: int | None) -> int:
    """The rank across an inner tile border (halo geometry never crosses the image border)."""
    if peer is None:
        raise RuntimeError("halo message across the image border: the exchange plan is inconsistent")
    return peer


class AxisPeers:
    """Global ranks of the previous/next tile along one axis (None at the image border)."""

    def __init__(self, prev: int | None, next_: int | None) -> None:
        self.prev = prev
        self.next = next_


class _HaloSpan:
    """An exchange's time on the tracer (``op`` events), leaving out work overlapped with it; no tracer: none."""

    def __init__(self, tracer: Tracer | None, op: str, layer: str) -> None:
        self.tracer, self.op, self.layer = tracer, op, layer
        self.start: Stamp | None = None
        self._begin()

    def _begin(self) -> None:
        self.start = self.tracer.stamp() if self.tracer is not None and self.tracer.enabled else None

    def end(self) -> None:
        if self.tracer is not None and self.start is not None:
            self.tracer.record(self.op, self.start, self.tracer.stamp(), layer=self.layer)
            self.start = None

    def outside(self, work: Callable[[], object]) -> None:
        """Run ``work`` untraced as halo time (the interior computed while messages fly)."""
        self.end()
        work()
        self._begin()


class HaloExchange:
    """This rank's halo exchange for one layer along every tiled axis, with an exact adjoint.

    ``pad_value`` fills needed positions outside the image (0 for conv/avg-pool, -inf for
    max-pool). Send and gradient staging buffers are reused across calls. Call it on the
    owned tile ``(..., *owned)``; it returns the needed tile ``(..., *needed)``. ``axes``: this
    tile's plan along each tiled axis; ``peers``: the ranks of its neighbours along each. ``via``: the route
    of the messages, the tile group of ``ranks`` (None: the world).
    """

    def __init__(self, geometry: LayerHalo, tile: int, ranks: Sequence[int], comm: Comm,
                 pad_value: float = 0.0, via: Group | None = None) -> None:
        grid = geometry.grid
        if len(ranks) != grid.num_tiles:
            raise ValueError(f"{len(ranks)} ranks given for {grid.num_tiles} tiles")
        if via is not None and tuple(via.ranks) != tuple(ranks):
            raise ValueError(f"halo route {via.ranks} is not the tile group {tuple(ranks)}")
        self.geometry, self.tile, self.comm, self.via = geometry, tile, comm, via
        self.pad_value = float(pad_value)
        self.axes: tuple[AxisExchange, ...] = geometry.tile(tile).axes

        def rank(axis: int, step: int) -> int | None:
            other = grid.axis_neighbor(tile, axis, step)
            return None if other is None else ranks[other]

        self.peers = tuple(AxisPeers(rank(k, -1), rank(k, 1)) for k in range(len(self.axes)))
        self.pool = BufferPool()
        self.identity = all(plan.is_trivial for plan in self.axes)
        self.talks = any(range_length(r) for plan in self.axes
                         for r in (plan.send_prev, plan.send_next, plan.recv_prev, plan.recv_next))
        self.messages_sent = 0
        blocks = region_blocks(self.axes, len(self.axes))
        self._needed_blocks = blocks
        self._own_blocks = tuple(b for b in blocks if b.source in (OWN, None))   # no message needed
        self._strip_blocks = [tuple(b for b in blocks if b.source in (1 + 2 * k, 2 + 2 * k))
                              for k in range(len(self.axes))]

    def __deepcopy__(self, memo: dict[int, object]) -> HaloExchange:
        return self   # holds the communicator: never copied

    @property
    def owned_shape(self) -> tuple[int, ...]:
        return tuple(range_length(plan.owned) for plan in self.axes)

    @property
    def needed_shape(self) -> tuple[int, ...]:
        return tuple(plan.needed_len for plan in self.axes)

    def _span(self, op: str) -> _HaloSpan:
        """The trace span of one exchange (none when no message moves: one tile along every axis)."""
        return _HaloSpan(self.comm.tracer if self.talks else None, op, self.geometry.name)

    def _tag(self, k: int, backward: bool) -> int:
        """The first of phase ``k``'s two tags (+1: the message towards the next tile)."""
        return HALO.tag((2 if k == len(self.axes) - 1 else 0) + (4 if backward else 0))

    def _staged(self, role: str, part: torch.Tensor) -> torch.Tensor:
        return part if part.is_contiguous() else self.pool.get(role, part.shape, part).copy_(part)

    def _later_owned(self, k: int, along: Range) -> tuple[Range, ...]:
        """``along`` on axis ``k`` and the owned range of the later axes: what phase ``k`` sends or receives."""
        return (along, *[plan.owned for plan in self.axes[k + 1:]])

    # ------------------------------------------------------------------ forward
    def _checked(self, x: torch.Tensor) -> torch.Tensor:
        n = len(self.axes)
        if tuple(x.shape[-n:]) != self.owned_shape:
            raise ValueError(f"{self.geometry.name}: tile {self.tile} got a {tuple(x.shape[-n:])} tile, expected "
                             f"{self.owned_shape} for a {'x'.join(map(str, self.geometry.sizes))} input (scatter "
                             f"inputs with dl.scatter_tiles)")
        return x.contiguous()

    def _piece(self, x: torch.Tensor, strips: Strips, k: int, sent: Range, role: str) -> torch.Tensor:
        """What phase ``k`` sends of ``sent`` (owned positions along axis ``k``): the tile as the earlier phases
        widened it, cut there."""
        if k == 0:
            plan = self.axes[0]
            return self._staged(role, x.narrow(-len(self.axes), sent[0] - plan.owned[0], range_length(sent)))
        ranges = self._later_owned(k, sent)
        lead = x.shape[:-len(self.axes)]
        buffer = self.pool.get(role, (*lead, *region_shape(self.axes, k, ranges)), x)
        return fill_blocks(buffer, region_blocks(self.axes, k, ranges), [x, *strips], self.pad_value)

    def _post(self, x: torch.Tensor, strips: Strips, k: int) -> Request:
        """Phase ``k`` posted: receive our strips along axis ``k`` into ``strips``, send the neighbours theirs."""
        plan, peers, tag = self.axes[k], self.peers[k], self._tag(k, False)
        lead = x.shape[:-len(self.axes)]
        transfers = []
        for slot, got, peer, their_tag in ((2 * k, plan.recv_prev, peers.prev, tag + 1),
                                           (2 * k + 1, plan.recv_next, peers.next, tag)):
            if range_length(got):
                strips[slot] = strip = x.new_empty((*lead, *strip_shape(self.axes, k, got)))
                transfers.append(Transfer.into(strip, neighbour_rank(peer), their_tag))
        for sent, peer, my_tag in ((plan.send_prev, peers.prev, tag), (plan.send_next, peers.next, tag + 1)):
            if range_length(sent):
                piece = self._piece(x, strips, k, sent, f"send{k}:{my_tag}")
                transfers.append(Transfer.to(piece, neighbour_rank(peer), my_tag))
                self.messages_sent += 1
        return self.comm.exchange(transfers, self.via) if transfers else Request.completed()

    def _exchange(self, x: torch.Tensor, build: bool,
                  during: Callable[[], object] | None = None) -> tuple[torch.Tensor | None, Strips]:
        """The strips received (and, with ``build``, the needed tile); ``during()`` runs while the first phase's
        messages fly."""
        x = self._checked(x)
        log = active_log()
        if log is not None and log.replaying:   # recomputation: the strips the first forward received
            kept = log.next_strips()
            if during is not None:
                during()
            return (self.rebuild(x, kept) if build else None), kept
        span = self._span("halo")
        strips: Strips = [None] * (2 * len(self.axes))
        out = None
        for k in range(len(self.axes)):
            request = self._post(x, strips, k)
            if k == 0:    # what needs no message, while the first phase's messages fly
                out = fill_blocks(self._new_needed(x), self._own_blocks, [x], self.pad_value) if build else None
                if during is not None:
                    span.outside(during)
            request.wait()
            if out is not None:
                fill_blocks(out, self._strip_blocks[k], [x, *strips], self.pad_value)
        span.end()
        if log is not None:
            log.record(strips)
        return out, strips

    def _new_needed(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-len(self.axes)], *self.needed_shape))

    def extend(self, x: torch.Tensor) -> tuple[torch.Tensor, Strips]:
        """The needed tile from the owned one, and the received strips (two per axis, previous then next
        neighbour's, kept for ``rebuild``)."""
        out, strips = self._exchange(x, build=True)
        assert out is not None
        return out, strips

    def exchange_strips(self, x: torch.Tensor) -> Strips:
        """Only the received strips, no needed tile assembled (the caller works on the owned
        tile and the strips directly)."""
        return self._exchange(x, build=False)[1]

    def exchange_strips_overlapped(self, x: torch.Tensor, during: Callable[[], T]) -> tuple[Strips, T]:
        """``exchange_strips(x)``, running ``during()`` (work that needs no strip: the tile's
        interior) while the first phase's messages are in flight; returns the strips and its result."""
        done: list[T] = []
        strips = self._exchange(x, build=False, during=lambda: done.append(during()))[1]
        return strips, done[0]

    def rebuild(self, x: torch.Tensor, strips: Strips) -> torch.Tensor:
        """``extend(x)[0]`` again from the saved strips, with no communication."""
        x = x.contiguous()
        return fill_blocks(self._new_needed(x), self._needed_blocks, [x, *strips], self.pad_value)

    def forward_tensor(self, x: torch.Tensor) -> torch.Tensor:
        return self.extend(x)[0]

    # ----------------------------------------------------------------- backward
    def strip_gradients(self, like: torch.Tensor, zeroed: bool = True) -> Strips:
        """A gradient buffer (``like``'s leading dims) for every strip this tile receives, None for the others."""
        make = like.new_zeros if zeroed else like.new_empty
        lead = like.shape[:-len(self.axes)]
        return [make((*lead, *strip_shape(self.axes, k, got))) if range_length(got) else None
                for k, plan in enumerate(self.axes) for got in (plan.recv_prev, plan.recv_next)]

    def backward_tensor(self, grad: torch.Tensor) -> torch.Tensor:
        """Adjoint of ``forward_tensor``: gradient w.r.t. the owned tile."""
        grad = grad.contiguous()
        trimmed = any(plan.keep != plan.owned for plan in self.axes)   # positions no block covers: zeros
        grad_x = (grad.new_zeros if trimmed else grad.new_empty)((*grad.shape[:-len(self.axes)], *self.owned_shape))
        strip_grads = self.strip_gradients(grad, zeroed=trimmed)
        scatter_blocks(grad, self._needed_blocks, [grad_x, *strip_grads], accumulate=False)
        return self.return_gradients(grad_x, strip_grads)

    def return_gradients(self, grad_x: torch.Tensor, strip_grads: Strips) -> torch.Tensor:
        """The adjoint's communication: send the received strips' gradients back and add the returned ones
        into ``grad_x`` (the owned tile's gradient, updated in place), phases reversed.

        ``strip_grads``: the gradients of the strips, as ``extend`` returned them (one for every received
        strip); those of the earlier phases are written to (the edges and corners arriving in the later
        phases' returns are added before they travel on)."""
        span = self._span("halo_backward")
        lead = grad_x.shape[:-len(self.axes)]
        for k in reversed(range(len(self.axes))):
            plan, peers, tag = self.axes[k], self.peers[k], self._tag(k, True)
            transfers, returned = [], []
            for sent, peer, their_tag in ((plan.send_prev, peers.prev, tag), (plan.send_next, peers.next, tag + 1)):
                if range_length(sent):
                    ranges = self._later_owned(k, sent)
                    buffer = self.pool.get(f"back{k}:{their_tag}", (*lead, *region_shape(self.axes, k, ranges)),
                                           grad_x)
                    transfers.append(Transfer.into(buffer, neighbour_rank(peer), their_tag))
                    returned.append((ranges, buffer))
            for slot, peer, my_tag in ((2 * k, peers.prev, tag + 1), (2 * k + 1, peers.next, tag)):
                part = strip_grads[slot]
                if part is not None:
                    transfers.append(Transfer.to(self._staged(f"grad{k}:{my_tag}", part), neighbour_rank(peer),
                                                 my_tag))
            if transfers:
                self.comm.exchange(transfers, self.via).wait()
            for ranges, buffer in returned:
                scatter_blocks(buffer, region_blocks(self.axes, k, ranges), [grad_x, *strip_grads])
        span.end()
        return grad_x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.identity else apply_exchange(x, self, adjoint=False)

    def adjoint(self, needed: torch.Tensor) -> torch.Tensor:
        """The adjoint as a differentiable map (needed tile -> owned tile: strips sent back and
        added, padding dropped); its backward is the exchange. A transposed conv's overlap-add."""
        return apply_exchange(needed, self, adjoint=True)


class LinearExchange(Protocol):
    """A halo exchange as a linear map owned tile -> needed tile, and its adjoint."""

    def forward_tensor(self, x: torch.Tensor) -> torch.Tensor: ...
    def backward_tensor(self, grad: torch.Tensor) -> torch.Tensor: ...


class _HaloCtx(FunctionContext, Protocol):
    exchange: LinearExchange
    adjoint: bool


class _HaloFunction(torch.autograd.Function):
    """The exchange (owned -> needed tile) or, with ``adjoint``, its adjoint; backward is the other."""

    @staticmethod
    def forward(fctx: _HaloCtx, x: torch.Tensor, exchange: LinearExchange, adjoint: bool) -> torch.Tensor:
        fctx.exchange, fctx.adjoint = exchange, adjoint
        return exchange.backward_tensor(x) if adjoint else exchange.forward_tensor(x)

    @staticmethod
    def backward(fctx: _HaloCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if fctx.adjoint:
            return fctx.exchange.forward_tensor(grad.contiguous()), None, None
        return fctx.exchange.backward_tensor(grad), None, None


def apply_exchange(x: torch.Tensor, exchange: LinearExchange, adjoint: bool) -> torch.Tensor:
    """``exchange`` (or, with ``adjoint``, its adjoint) as a differentiable map; backward is the other."""
    out: torch.Tensor = _HaloFunction.apply(x, exchange, adjoint)
    return out
