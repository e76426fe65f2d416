"""Halo exchange as an autograd Function whose backward is the exact adjoint.

Forward, two phases so corners arrive without diagonal messages: rows are exchanged with
the top/bottom neighbours (over the owned columns), then columns with the left/right
neighbours over the full needed row range (which includes the rows just received). The
tile's kept rows/columns, the received strips and the layer's padding value outside the
image are laid straight into one new tensor covering the needed box — one copy of the
tile per exchange. Backward is the adjoint, phases reversed: the gradient of every
received strip travels back to its owner and is added into what it sent; trimmed and
padding positions get no gradient.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol, TypeVar

import torch

from ..comm.handles import Transfer
from ..comm.protocol import Comm
from ..comm.tags import HALO
from ..comm.trace import Stamp, Tracer
from .function_ctx import FunctionContext
from .geometry import AxisExchange, LayerHalo
from .replay import Strips, active_log

T = TypeVar("T")

# (phase, forward/backward) -> first of its two tags (+1: the message towards the next tile)
_ROWS_F, _COLS_F, _ROWS_B, _COLS_B = (HALO.tag(offset) for offset in (0, 2, 4, 6))

# Strips: [rows from prev, rows from next, cols from prev, cols from next] (None: nothing received)
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


def _len(r: tuple[int, int]) -> int:
    return max(0, r[1] - r[0])


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


def _fill_rows_own(out: torch.Tensor, x: torch.Tensor, rows: AxisExchange, c0: int, c1: int,
                   pad_value: float) -> None:
    """Padding rows and the tile's kept rows of own columns ``c0:c1`` into ``out`` (N, C, Hn, c1-c0)."""
    if rows.pad_before:
        out.narrow(-2, 0, rows.pad_before).fill_(pad_value)
    if rows.pad_after:
        out.narrow(-2, rows.needed_len - rows.pad_after, rows.pad_after).fill_(pad_value)
    if _len(rows.keep):
        out.narrow(-2, rows.offset(rows.keep[0]), _len(rows.keep)).copy_(
            x[..., rows.keep[0] - rows.owned[0]:rows.keep[1] - rows.owned[0], c0:c1])


def _fill_rows_strips(out: torch.Tensor, strips: Strips, rows: AxisExchange, c0: int,
                      c1: int) -> None:
    """The received row strips (own columns ``c0:c1``) into ``out``."""
    for rng, strip in ((rows.recv_prev, strips[0]), (rows.recv_next, strips[1])):
        if strip is not None:
            out.narrow(-2, rows.offset(rng[0]), _len(rng)).copy_(strip[..., c0:c1])


class HaloExchange:
    """This rank's halo exchange for one layer: rows then columns, with an exact adjoint.

    ``pad_value`` fills needed positions outside the image (0 for conv/avg-pool, -inf for
    max-pool). Send and gradient staging buffers are reused across calls. Call it on the
    owned tile ``(N, C, h, w)``; it returns the needed tile ``(N, C, h_needed, w_needed)``.
    """

    def __init__(self, geometry: LayerHalo, tile: int, ranks: Sequence[int], comm: Comm,
                 pad_value: float = 0.0) -> None:
        grid = geometry.grid
        if len(ranks) != grid.num_tiles:
            raise ValueError(f"{len(ranks)} ranks given for {grid.num_tiles} tiles")
        self.geometry = geometry
        self.tile = tile
        self.comm = comm
        self.pad_value = float(pad_value)
        view = geometry.tile(tile)
        self.rows, self.cols = view.rows, view.cols
        row, col = grid.position(tile)

        def rank(t: int | None) -> int | None:
            return None if t is None else ranks[t]

        self.row_peers = AxisPeers(rank(grid.tile_at(row - 1, col)), rank(grid.tile_at(row + 1, col)))
        self.col_peers = AxisPeers(rank(grid.tile_at(row, col - 1)), rank(grid.tile_at(row, col + 1)))
        self.pool = BufferPool()
        self.identity = self.rows.is_trivial and self.cols.is_trivial
        self.messages_sent = 0

    def __deepcopy__(self, memo: dict[int, object]) -> HaloExchange:
        return self   # holds the communicator: never copied

    def _count(self, plan: AxisExchange) -> int:
        return sum(1 for r in (plan.send_prev, plan.send_next) if _len(r))

    def _tracing(self) -> tuple[Tracer, Stamp | None]:
        tracer = self.comm.tracer
        return tracer, (tracer.stamp() if tracer.enabled else None)

    def _staged(self, role: str, part: torch.Tensor) -> torch.Tensor:
        return part if part.is_contiguous() else self.pool.get(role, part.shape, part).copy_(part)

    # ------------------------------------------------------------------ forward
    def _new_extended(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-2], self.rows.needed_len, self.cols.needed_len))

    def _own_block(self, out: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        cols = self.cols
        c0, c1 = cols.keep[0] - cols.owned[0], cols.keep[1] - cols.owned[0]
        return out.narrow(-1, cols.offset(cols.keep[0]), c1 - c0), c0, c1

    def _fill_cols(self, out: torch.Tensor, strips: Strips) -> None:
        cols = self.cols
        if cols.pad_before:
            out.narrow(-1, 0, cols.pad_before).fill_(self.pad_value)
        if cols.pad_after:
            out.narrow(-1, cols.needed_len - cols.pad_after, cols.pad_after).fill_(self.pad_value)
        for rng, strip in ((cols.recv_prev, strips[2]), (cols.recv_next, strips[3])):
            if strip is not None:
                out.narrow(-1, cols.offset(rng[0]), _len(rng)).copy_(strip)

    def extend(self, x: torch.Tensor) -> tuple[torch.Tensor, Strips]:
        """The needed tile from the owned one, and the received strips (kept for ``rebuild``)."""
        out, strips = self._exchange(x, build=True)
        assert out is not None
        return out, strips

    def exchange_strips(self, x: torch.Tensor) -> Strips:
        """Only the received strips, no needed tile assembled (the caller works on the owned
        tile and the strips directly)."""
        return self._exchange(x, build=False)[1]

    def exchange_strips_overlapped(self, x: torch.Tensor, during: Callable[[], T]) -> tuple[Strips, T]:
        """``exchange_strips(x)``, running ``during()`` (work that needs no strip: the tile's
        interior) while the row messages are in flight; returns the strips and its result."""
        done: list[T] = []
        strips = self._exchange(x, build=False, during=lambda: done.append(during()))[1]
        return strips, done[0]

    def _exchange(self, x: torch.Tensor, build: bool,
                  during: Callable[[], object] | None = None) -> tuple[torch.Tensor | None, Strips]:
        rows, cols, comm = self.rows, self.cols, self.comm
        expected = (_len(rows.owned), _len(cols.owned))
        if tuple(x.shape[-2:]) != expected:
            raise ValueError(f"{self.geometry.name}: tile {self.tile} got a {tuple(x.shape[-2:])} "
                             f"tile, expected {expected} for a {self.geometry.height}x"
                             f"{self.geometry.width} input (scatter inputs with dl.scatter_tiles)")
        x = x.contiguous()
        log = active_log()
        if log is not None and log.replaying:   # recomputation: the strips the first forward received
            kept = log.next_strips()
            if during is not None:
                during()
            return (self.rebuild(x, kept) if build else None), kept
        tracer, start = self._tracing()
        lead, width = x.shape[:-2], x.shape[-1]
        strips: Strips = [None, None, None, None]
        # phase 1: rows, from the owned tile (one exchange: at most one message per direction
        # and neighbour, so both sides post in the same order by construction)
        transfers = []
        for slot, rng, peer, tag in ((0, rows.recv_prev, self.row_peers.prev, _ROWS_F + 1),
                                     (1, rows.recv_next, self.row_peers.next, _ROWS_F)):
            if _len(rng):
                strips[slot] = strip = x.new_empty((*lead, _len(rng), width))
                transfers.append(Transfer.into(strip, neighbour_rank(peer), tag))
        for rng, peer, tag in ((rows.send_prev, self.row_peers.prev, _ROWS_F),
                               (rows.send_next, self.row_peers.next, _ROWS_F + 1)):
            if _len(rng):
                part = x.narrow(-2, rng[0] - rows.owned[0], _len(rng))
                transfers.append(Transfer.to(self._staged(f"sr{tag}", part), neighbour_rank(peer), tag))
        request = comm.exchange(transfers)
        out = block = None
        if build:
            out = self._new_extended(x)
            block, c0, c1 = self._own_block(out)
            _fill_rows_own(block, x, rows, c0, c1, self.pad_value)
        if during is not None:   # halo overlap: compute while the row messages fly (not traced as halo)
            if start is not None:
                tracer.record("halo", start, tracer.stamp(), layer=self.geometry.name)
            during()
            tracer, start = self._tracing()
        request.wait()
        if block is not None:
            _fill_rows_strips(block, strips, rows, c0, c1)
        # phase 2: columns over the full needed row range (corners included)
        transfers = []
        for slot, rng, peer, tag in ((2, cols.recv_prev, self.col_peers.prev, _COLS_F + 1),
                                     (3, cols.recv_next, self.col_peers.next, _COLS_F)):
            if _len(rng):
                strips[slot] = strip = x.new_empty((*lead, rows.needed_len, _len(rng)))
                transfers.append(Transfer.into(strip, neighbour_rank(peer), tag))
        for rng, peer, tag in ((cols.send_prev, self.col_peers.prev, _COLS_F),
                               (cols.send_next, self.col_peers.next, _COLS_F + 1)):
            if _len(rng):
                s0, s1 = rng[0] - cols.owned[0], rng[1] - cols.owned[0]
                piece = self.pool.get(f"sc{tag}", (*lead, rows.needed_len, s1 - s0), x)
                _fill_rows_own(piece, x, rows, s0, s1, self.pad_value)
                _fill_rows_strips(piece, strips, rows, s0, s1)
                transfers.append(Transfer.to(piece, neighbour_rank(peer), tag))
        comm.exchange(transfers).wait()
        if out is not None:
            self._fill_cols(out, strips)
        self.messages_sent += self._count(rows) + self._count(cols)
        if start is not None:
            tracer.record("halo", start, tracer.stamp(), layer=self.geometry.name)
        if log is not None:
            log.record(strips)
        return out, strips

    def rebuild(self, x: torch.Tensor, strips: Strips) -> torch.Tensor:
        """``extend(x)[0]`` again from the saved strips, with no communication."""
        x = x.contiguous()
        out = self._new_extended(x)
        block, c0, c1 = self._own_block(out)
        _fill_rows_own(block, x, self.rows, c0, c1, self.pad_value)
        _fill_rows_strips(block, strips, self.rows, c0, c1)
        self._fill_cols(out, strips)
        return out

    def forward_tensor(self, x: torch.Tensor) -> torch.Tensor:
        return self.extend(x)[0]

    # ----------------------------------------------------------------- backward
    def backward_tensor(self, grad: torch.Tensor) -> torch.Tensor:
        """Adjoint of ``forward_tensor``: gradient w.r.t. the owned tile."""
        rows, cols = self.rows, self.cols
        grad = grad.contiguous()
        lead = grad.shape[:-2]
        height, width = _len(rows.owned), _len(cols.owned)
        kr0, kr1 = rows.keep[0] - rows.owned[0], rows.keep[1] - rows.owned[0]
        kc0, kc1 = cols.keep[0] - cols.owned[0], cols.keep[1] - cols.owned[0]
        col_grads = [grad.narrow(-1, cols.offset(rng[0]), _len(rng)) if _len(rng) else None
                     for rng in (cols.recv_prev, cols.recv_next)]
        trimmed = rows.keep != rows.owned or cols.keep != cols.owned
        make = grad.new_zeros if trimmed else grad.new_empty
        grad_x = make((*lead, height, width))
        if kr1 > kr0 and kc1 > kc0:
            grad_x[..., kr0:kr1, kc0:kc1] = grad[..., rows.offset(rows.keep[0]):
                                                 rows.offset(rows.keep[1]),
                                                 cols.offset(cols.keep[0]):
                                                 cols.offset(cols.keep[1])]
        row_grads: list[torch.Tensor | None] = [None, None]
        for slot, rng in ((0, rows.recv_prev), (1, rows.recv_next)):
            if _len(rng):
                g = (grad.new_zeros if cols.keep != cols.owned else grad.new_empty)(
                    (*lead, _len(rng), width))
                if kc1 > kc0:
                    g[..., kc0:kc1] = grad[..., rows.offset(rng[0]):rows.offset(rng[1]),
                                           cols.offset(cols.keep[0]):cols.offset(cols.keep[1])]
                row_grads[slot] = g
        return self.return_gradients(grad_x, col_grads, row_grads)

    def return_gradients(self, grad_x: torch.Tensor, col_grads: Strips,
                         row_grads: Strips) -> torch.Tensor:
        """The adjoint's communication: send the received strips' gradients back and add
        the returned ones into ``grad_x`` (the owned tile's gradient, updated in place).

        ``col_grads`` are the gradients of the column strips received from the previous /
        next column neighbour, over the full needed row range ``(N, C, rows.needed_len, w)``;
        ``row_grads`` those of the row strips over the owned columns ``(N, C, h, width)``
        (written to: the corner gradients arriving from column neighbours are added).
        """
        rows, cols, comm = self.rows, self.cols, self.comm
        tracer, start = self._tracing()
        lead = grad_x.shape[:-2]
        width = _len(cols.owned)
        kr0, kr1 = rows.keep[0] - rows.owned[0], rows.keep[1] - rows.owned[0]
        # phase 2 adjoint: column strips' gradients back to their owners
        transfers, from_cols = [], []
        for rng, peer, tag in ((cols.send_prev, self.col_peers.prev, _COLS_B),
                               (cols.send_next, self.col_peers.next, _COLS_B + 1)):
            if _len(rng):
                buf = self.pool.get(f"gc{tag}", (*lead, rows.needed_len, _len(rng)), grad_x)
                transfers.append(Transfer.into(buf, neighbour_rank(peer), tag))
                from_cols.append((rng, buf))
        for part, peer, tag in ((col_grads[0], self.col_peers.prev, _COLS_B + 1),
                                (col_grads[1], self.col_peers.next, _COLS_B)):
            if part is not None:
                transfers.append(Transfer.to(self._staged(f"bc{tag}", part), neighbour_rank(peer), tag))
        comm.exchange(transfers).wait()
        for rng, buf in from_cols:
            s0, s1 = rng[0] - cols.owned[0], rng[1] - cols.owned[0]
            if kr1 > kr0:
                grad_x[..., kr0:kr1, s0:s1] += buf[..., rows.offset(rows.keep[0]):
                                                    rows.offset(rows.keep[1]), :]
            for row_grad, rr in zip(row_grads, (rows.recv_prev, rows.recv_next)):
                if row_grad is not None:
                    row_grad[..., s0:s1] += buf[..., rows.offset(rr[0]):rows.offset(rr[1]), :]
        # phase 1 adjoint: row strips' gradients (corners included) back to their owners
        transfers, from_rows = [], []
        for rng, peer, tag in ((rows.send_prev, self.row_peers.prev, _ROWS_B),
                               (rows.send_next, self.row_peers.next, _ROWS_B + 1)):
            if _len(rng):
                buf = self.pool.get(f"gr{tag}", (*lead, _len(rng), width), grad_x)
                transfers.append(Transfer.into(buf, neighbour_rank(peer), tag))
                from_rows.append((rng, buf))
        for g, peer, tag in ((row_grads[0], self.row_peers.prev, _ROWS_B + 1),
                             (row_grads[1], self.row_peers.next, _ROWS_B)):
            if g is not None:
                transfers.append(Transfer.to(self._staged(f"br{tag}", g), neighbour_rank(peer), tag))
        comm.exchange(transfers).wait()
        for rng, buf in from_rows:
            grad_x[..., rng[0] - rows.owned[0]:rng[1] - rows.owned[0], :] += buf
        if start is not None:
            tracer.record("halo_backward", start, tracer.stamp(), layer=self.geometry.name)
        return grad_x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.identity:
            return x
        return _HaloFunction.apply(x, self, False)

    def adjoint(self, needed: torch.Tensor) -> torch.Tensor:
        """The adjoint as a differentiable map (needed tile -> owned tile: strips sent back and
        added, padding dropped); its backward is the exchange. A transposed conv's overlap-add."""
        return _HaloFunction.apply(needed, self, True)


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


def halo_exchange(x: torch.Tensor, exchange: HaloExchange) -> torch.Tensor:
    """Functional form: ``exchange(x)``."""
    return exchange(x)
