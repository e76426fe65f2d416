"""An in-process stand-in for a group of ranks: the communicator a stage needs, without MPI.

``FakeWorld(n)`` hands out one ``FakeComm`` per simulated rank, each run by its own thread.
Object collectives are real (the threads meet, so a spatialized stage learns every tile's
size exactly as on MPI ranks); tensors are never delivered: a simulation needs their shapes
only (receive buffers are zero-filled off the ``meta`` device, so a timed run computes on
defined numbers). Every message and collective is counted, and every receive buffer is
reported to ``on_receive``, so a memory simulation can tell halo strips apart.

A comm made with ``sizes=SizeOracle(...)`` runs alone: it answers the only object gather a
spatialized layer makes - every tile's local size of a map - from the map sizes the layer
produces when run whole, so a single tile can be simulated (or timed) without the others.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import torch

from ..comm.handles import Channel, Group, Request, Transfer
from ..comm.trace import Tracer

RENDEZVOUS_SECONDS = 120.0

T = TypeVar("T")   # what an object collective carries
R = TypeVar("R")   # what a simulated rank's body returns
MeetingKey = tuple[tuple[int, ...], int]   # (the ranks that meet, how many times they met before)


@dataclass
class Traffic:
    """What one simulated rank sent: point-to-point messages and collectives (bytes)."""

    messages: int = 0
    message_bytes: int = 0
    collectives: int = 0
    collective_bytes: int = 0
    exchanges: int = 0        # exchange calls that carried messages (each a meeting with neighbours)

    def copy(self) -> Traffic:
        return Traffic(self.messages, self.message_bytes, self.collectives, self.collective_bytes,
                       self.exchanges)

    def minus(self, other: Traffic) -> Traffic:
        return Traffic(self.messages - other.messages, self.message_bytes - other.message_bytes,
                       self.collectives - other.collectives,
                       self.collective_bytes - other.collective_bytes, self.exchanges - other.exchanges)

    @property
    def meetings(self) -> int:
        """Times this rank waits for others: halo exchanges and collectives."""
        return self.exchanges + self.collectives


class FakeWorld:
    """``size`` simulated ranks that meet for object collectives (threads, one per rank)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._cond = threading.Condition()
        self._slots: dict[MeetingKey, dict[int, object]] = {}
        self.failed = False

    def comm(self, rank: int, device: torch.device | str = "meta") -> FakeComm:
        return FakeComm(rank, self, torch.device(device))

    def meet(self, key: MeetingKey, ranks: Sequence[int], rank: int, obj: T) -> list[T]:
        """Every rank of ``ranks`` contributes ``obj`` under ``key``; all get the list."""
        with self._cond:
            slot = self._slots.setdefault(key, {})
            slot[rank] = obj
            self._cond.notify_all()
            done = self._cond.wait_for(lambda: self.failed or len(slot) == len(ranks),
                                       RENDEZVOUS_SECONDS)
            if self.failed:
                raise RuntimeError(f"simulated rank {rank}: another rank failed")
            if not done:
                raise RuntimeError(f"simulated ranks {list(ranks)}: rank {rank} waited "
                                   f"{RENDEZVOUS_SECONDS:.0f} s for a collective the others never "
                                   f"joined (the simulated stage diverged between tiles)")
            return [cast(T, slot[r]) for r in ranks]   # every rank of a meeting passes the same kind

    def fail(self) -> None:
        """Wake every waiting rank with an error (one rank raised)."""
        with self._cond:
            self.failed = True
            self._cond.notify_all()


class AmbiguousSize(RuntimeError):
    """The size oracle cannot tell which map a tile's size belongs to (simulate all tiles)."""


@dataclass(frozen=True)
class SizeOracle:
    """Every tile's local size of a map, from one tile's: the map is the one among ``maps``
    (the (H, W) sizes the layer's whole-map run produced) whose tile has that size."""

    rows: int
    cols: int
    maps: frozenset[tuple[int, int]]

    def all_tiles(self, tile: int, local: object) -> list[tuple[int, int]]:
        from ..spatial.geometry import TileGrid

        grid = TileGrid(self.rows, self.cols)
        if not (isinstance(local, tuple) and len(local) == 2):
            raise AmbiguousSize(f"an object gather of {local!r} is not a tile size")
        found = {m for m in self.maps if grid.tile_of_size(tile, *m) == tuple(local)}
        layouts = {tuple(grid.tile_of_size(t, *m) for t in range(grid.num_tiles)) for m in found}
        if len(layouts) != 1:
            raise AmbiguousSize(f"tile {tile} of size {local} fits {len(found)} map sizes")
        return list(layouts.pop())


class FakeComm:
    """One simulated rank's communicator (implements ``comm.protocol.Comm``)."""

    def __init__(self, rank: int, world: FakeWorld | None, device: torch.device,
                 world_size: int | None = None, sizes: SizeOracle | None = None) -> None:
        self._rank = rank
        self.world = world
        self._world_size = world.size if world is not None else int(world_size or 1)
        self._device = device
        self._tracer = Tracer(rank, enabled=False)
        self._sizes = sizes
        self._calls: dict[tuple[int, ...], int] = {}
        self.traffic = Traffic()
        self.on_receive: Callable[[torch.Tensor], None] | None = None

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tracer(self) -> Tracer:
        return self._tracer

    # ---------------------------------------------------------- point to point
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Request:
        self.traffic.messages += 1
        self.traffic.message_bytes += tensor.numel() * tensor.element_size()
        return Request.completed()

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Request:
        if tensor.device.type != "meta":
            tensor.zero_()
        if self.on_receive is not None:
            self.on_receive(tensor)
        return Request.completed()

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        self.irecv(tensor, src, tag)
        return tensor

    def exchange(self, transfers: Sequence[Transfer], via: Group | Channel | None = None) -> Request:
        self.traffic.exchanges += bool(transfers)
        for transfer in transfers:
            (self.isend if transfer.send else self.irecv)(transfer.tensor, transfer.peer, transfer.tag)
        return Request.completed()

    def exchange_host(self, transfers: Sequence[Transfer]) -> Request:
        """A payload's header: nothing delivered, like every other message."""
        return self.exchange(transfers)

    def channels(self, pairs: Iterable[tuple[int, int]]) -> dict[tuple[int, int], Channel]:
        return {(int(src), int(dst)): Channel(int(src), int(dst)) for src, dst in pairs}

    @staticmethod
    def wait_all(requests: Sequence[Request]) -> None:
        for request in requests:
            request.wait()

    # ------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, group: Group | None = None) -> torch.Tensor:
        self.traffic.collectives += 1
        self.traffic.collective_bytes += tensor.numel() * tensor.element_size()
        return tensor

    def iall_reduce(self, tensor: torch.Tensor, group: Group | None = None) -> Request:
        self.all_reduce(tensor, group)
        return Request.completed()

    def broadcast(self, tensor: torch.Tensor, root: int, group: Group | None = None) -> torch.Tensor:
        return self.all_reduce(tensor, group)

    def reduce_scatter(self, flat: torch.Tensor, counts: Sequence[int], group: Group | None = None) -> torch.Tensor:
        """This rank's piece of ``flat`` (traffic counted; the other members' sums are not simulated)."""
        self.all_reduce(flat, group)
        start = sum(counts[:self._ranks(group).index(self._rank)])
        return flat[start:start + counts[self._ranks(group).index(self._rank)]].clone()

    def all_gather(self, piece: torch.Tensor, counts: Sequence[int], group: Group | None = None) -> torch.Tensor:
        """``piece`` in this rank's place, zeros in the others' (traffic counted; their pieces are not simulated)."""
        whole = piece.new_zeros(sum(counts))
        start = sum(counts[:self._ranks(group).index(self._rank)])
        whole[start:start + piece.numel()] = piece.reshape(-1)
        return self.all_reduce(whole, group)

    def new_group(self, ranks: Iterable[int]) -> Group:
        return Group(tuple(ranks))

    def _ranks(self, group: Group | None) -> tuple[int, ...]:
        return tuple(group.ranks) if group is not None else tuple(range(self._world_size))

    def _meet(self, obj: T, group: Group | None) -> list[T]:
        ranks = self._ranks(group)
        if self._sizes is not None:   # the one gather a spatialized layer makes: tile sizes
            return cast(list[T], self._sizes.all_tiles(ranks.index(self._rank), obj))
        if self.world is None:
            raise RuntimeError("a FakeComm without a world answers collectives only with sizes=")
        count = self._calls.get(ranks, 0)
        self._calls[ranks] = count + 1
        return self.world.meet((ranks, count), ranks, self._rank, obj)

    def barrier(self, group: Group | None = None) -> None:
        if self._sizes is None:
            self._meet(None, group)

    def all_gather_object(self, obj: T, group: Group | None = None) -> list[T]:
        return self._meet(obj, group)

    def bcast_object(self, obj: T, root: int = 0, group: Group | None = None) -> T:
        ranks = self._ranks(group)
        return self._meet(obj, group)[ranks.index(root)]

    def gather_object(self, obj: T, root: int = 0) -> list[T] | None:
        gathered = self._meet(obj, None)
        return gathered if self._rank == root else None

    def scatter_object(self, pieces: Sequence[T] | None, root: int = 0) -> T:
        gathered = self._meet(pieces, None)[root]
        if gathered is None:
            raise RuntimeError(f"simulated rank {root} scattered nothing (pieces=None on the root)")
        return gathered[self._rank]

    def abort(self, code: int = 1) -> None:
        raise RuntimeError(f"simulated rank {self._rank} aborted (code {code})")


def run_ranks(world: FakeWorld, body: Callable[[int], R]) -> list[R]:
    """``body(rank)`` for every rank of ``world``, each in its own thread; results by rank.

    The first exception any rank raised is re-raised here (after every thread ended).
    """
    results: list[R | None] = [None] * world.size
    errors: list[BaseException | None] = [None] * world.size

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as exc:   # re-raised in the caller's thread
            errors[rank] = exc
            world.fail()

    if world.size == 1:
        run(0)
    else:
        threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(world.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    first = next((e for e in errors if e is not None and not _secondary(e)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return cast(list[R], results)   # every rank returned: none is left None


def _secondary(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and "another rank failed" in str(error)
