"""AxesHaloExchange: a halo exchange along every tiled axis, one phase per axis (volumes' tiles).

Phase ``k`` widens the tile along axis ``k`` (depth, rows, cols, outermost first): the strips the
neighbours along that axis need are cut from the tile as it stands, i.e. already widened along
the earlier axes, so edges and corners travel in the later phases without diagonal messages.
The tile's kept part, the received strips and the layer's padding value are joined along the
axis. Backward is the adjoint, phases reversed: each received strip's gradient goes back to its
owner and is added into what it sent; trimmed and padding positions get no gradient. The same
code serves any number of axes (tests check it on 2-D grids against ``HaloExchange``).

Tags: a pair of ranks are neighbours along one axis only, so the depth phase reuses the row
phase's tags (HALO's offsets 0-3 forward, 4-7 backward), as the messages of one pair never mix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comm.handles import Transfer
from ..comm.protocol import Comm
from ..comm.tags import HALO
from .geometry import AxisExchange, LayerHalo, range_length
from .halo import AxisPeers, apply_exchange, neighbour_rank
from .replay import Strips, active_log

_FORWARD = {3: HALO.tag(0), 2: HALO.tag(0), 1: HALO.tag(2)}    # axes left to the end -> first tag
_BACKWARD = {3: HALO.tag(4), 2: HALO.tag(4), 1: HALO.tag(6)}


class AxesHaloExchange:
    """This rank's halo exchange for one layer along every tiled axis, with an exact adjoint.

    Call it on the owned tile ``(..., *owned)``; it returns the needed tile ``(..., *needed)``
    (``pad_value`` outside the image: 0 for conv/avg-pool, -inf for max-pool).
    """

    def __init__(self, geometry: LayerHalo, tile: int, ranks: Sequence[int], comm: Comm,
                 pad_value: float = 0.0) -> None:
        grid = geometry.grid
        if len(ranks) != grid.num_tiles:
            raise ValueError(f"{len(ranks)} ranks given for {grid.num_tiles} tiles")
        self.geometry, self.tile, self.comm = geometry, tile, comm
        self.pad_value = float(pad_value)
        self.axes: tuple[AxisExchange, ...] = geometry.tile(tile).axes

        def rank(step: int, axis: int) -> int | None:
            other = grid.axis_neighbor(tile, axis, step)
            return None if other is None else ranks[other]

        self.peers = [AxisPeers(rank(-1, k), rank(1, k)) for k in range(len(self.axes))]
        self.identity = all(plan.is_trivial for plan in self.axes)
        self.messages_sent = 0

    def __deepcopy__(self, memo: dict[int, object]) -> AxesHaloExchange:
        return self   # holds the communicator: never copied

    def _dim(self, k: int) -> int:
        return k - len(self.axes)

    # ------------------------------------------------------------------ forward
    def forward_tensor(self, x: torch.Tensor) -> torch.Tensor:
        return self.extend(x)[0]

    def extend(self, x: torch.Tensor) -> tuple[torch.Tensor, Strips]:
        """The needed tile from the owned one, and the received strips (two per axis, each cut from the tile
        as widened by the earlier phases: kept for ``rebuild``, they hold no padding and no owned position)."""
        expected = tuple(range_length(plan.owned) for plan in self.axes)
        if tuple(x.shape[-len(expected):]) != expected:
            raise ValueError(f"{self.geometry.name}: tile {self.tile} got a {tuple(x.shape)} tile, expected "
                             f"{expected} in its last dims (scatter inputs with dl.scatter_tiles)")
        log = active_log()
        kept = log.next_strips() if log is not None and log.replaying else None
        received: Strips = []
        for k, plan in enumerate(self.axes):
            strips = kept[2 * k:2 * k + 2] if kept is not None else self._receive(x, k, plan)
            received.extend(strips)
            x = self._joined(x, k, plan, strips)
        if log is not None and kept is None:
            log.record(received)
        return x, received

    def rebuild(self, x: torch.Tensor, strips: Strips) -> torch.Tensor:
        """``extend(x)[0]`` again from the owned tile and the saved strips, with no communication."""
        for k, plan in enumerate(self.axes):
            x = self._joined(x, k, plan, strips[2 * k:2 * k + 2])
        return x

    def _receive(self, x: torch.Tensor, k: int, plan: AxisExchange) -> Strips:
        """Phase ``k``: send the neighbours their strips of ``x``, receive ours."""
        dim, tag, peers = self._dim(k), _FORWARD[len(self.axes) - k], self.peers[k]
        strips: Strips = [None, None]
        transfers = []
        for slot, rng, peer, their_tag in ((0, plan.recv_prev, peers.prev, tag + 1),
                                           (1, plan.recv_next, peers.next, tag)):
            if range_length(rng):
                shape = list(x.shape)
                shape[dim] = range_length(rng)
                strips[slot] = strip = x.new_empty(shape)
                transfers.append(Transfer.into(strip, neighbour_rank(peer), their_tag))
        for rng, peer, my_tag in ((plan.send_prev, peers.prev, tag), (plan.send_next, peers.next, tag + 1)):
            if range_length(rng):
                part = x.narrow(dim, rng[0] - plan.owned[0], range_length(rng)).contiguous()
                transfers.append(Transfer.to(part, neighbour_rank(peer), my_tag))
                self.messages_sent += 1
        if transfers:
            self.comm.exchange(transfers).wait()
        return strips

    def _joined(self, x: torch.Tensor, k: int, plan: AxisExchange, strips: Strips) -> torch.Tensor:
        """Padding, received strips and kept part of ``x`` along axis ``k``: its needed range."""
        dim = self._dim(k)

        def padding(length: int) -> torch.Tensor:
            shape = list(x.shape)
            shape[dim] = length
            return x.new_full(shape, self.pad_value)

        pieces = [padding(plan.pad_before)] if plan.pad_before else []
        if strips[0] is not None:
            pieces.append(strips[0])
        if range_length(plan.keep):
            pieces.append(x.narrow(dim, plan.keep[0] - plan.owned[0], range_length(plan.keep)))
        if strips[1] is not None:
            pieces.append(strips[1])
        if plan.pad_after:
            pieces.append(padding(plan.pad_after))
        return torch.cat(pieces, dim)

    # ----------------------------------------------------------------- backward
    def backward_tensor(self, grad: torch.Tensor) -> torch.Tensor:
        """Adjoint of ``forward_tensor``: gradient w.r.t. the owned tile (phases reversed)."""
        for k in reversed(range(len(self.axes))):
            grad = self._returned(grad.contiguous(), k, self.axes[k])
        return grad

    def _returned(self, grad: torch.Tensor, k: int, plan: AxisExchange) -> torch.Tensor:
        """Adjoint of phase ``k``: the strips' gradients back to their owners, theirs added in."""
        dim, tag, peers = self._dim(k), _BACKWARD[len(self.axes) - k], self.peers[k]
        shape = list(grad.shape)
        shape[dim] = range_length(plan.owned)
        own = grad.new_zeros(shape)
        if range_length(plan.keep):
            own.narrow(dim, plan.keep[0] - plan.owned[0], range_length(plan.keep)).copy_(
                grad.narrow(dim, plan.offset(plan.keep[0]), range_length(plan.keep)))
        transfers, returned = [], []
        for rng, peer, their_tag in ((plan.send_prev, peers.prev, tag + 1), (plan.send_next, peers.next, tag)):
            if range_length(rng):
                shape[dim] = range_length(rng)
                buf = grad.new_empty(shape)
                transfers.append(Transfer.into(buf, neighbour_rank(peer), their_tag))
                returned.append((rng, buf))
        for rng, peer, my_tag in ((plan.recv_prev, peers.prev, tag), (plan.recv_next, peers.next, tag + 1)):
            if range_length(rng):
                part = grad.narrow(dim, plan.offset(rng[0]), range_length(rng)).contiguous()
                transfers.append(Transfer.to(part, neighbour_rank(peer), my_tag))
        if transfers:
            self.comm.exchange(transfers).wait()
        for rng, buf in returned:
            own.narrow(dim, rng[0] - plan.owned[0], range_length(rng)).add_(buf)
        return own

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.identity else apply_exchange(x, self, adjoint=False)

    def adjoint(self, needed: torch.Tensor) -> torch.Tensor:
        """The adjoint as a differentiable map (needed tile -> owned tile); its backward is the exchange."""
        return apply_exchange(needed, self, adjoint=True)
