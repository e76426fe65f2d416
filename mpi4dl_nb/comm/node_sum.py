"""Sums of CPU tensors over ranks that share one node, through an MPI shared-memory window: one copy fewer than an
all-reduce's messages (docs/spatial.md, "On one node"; BENCHMARKS.md §17).

Each member writes into its slab of one ``MPI_Win_allocate_shared`` window the elements the others sum (all but its
own 1/P share), sums its own share in rank order (every member gets the same bits) and copies the P summed shares
back in place. The barriers follow MPI-3's unified-memory rule (``Win_sync``, a barrier, ``Win_sync``): a member
writes the others' elements of its slab only between the second barrier of one sum and the first of the next, its
own share only between the first and the second. The window grows collectively and is kept for the process's life
(MPICH unlinks the segment once attached); where ``/dev/shm`` has less than twice the growth free, ``reserve``
declines on every member and the caller keeps its all-reduce (a full tmpfs would kill the rank with SIGBUS).
``common`` maps one memory into every member (ZeRO's whole weights: ``node_shards.py``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import torch

from .handles import Group
from .mpi_plane import MpiRequests
from .waiting import WaitMode

if TYPE_CHECKING:
    from mpi4py import MPI

SUMMED_DTYPES = (torch.float32, torch.float64)   # what MPI's SUM on the CPU gives too
ALIGN = 64                                       # bytes: every view starts on a cache line
SHM_DIR = "/dev/shm"
ROOM_FACTOR = 2.0                                # free room asked of /dev/shm over the window's size


def shm_room(path: str = SHM_DIR) -> int | None:
    """Free bytes of the node's shared-memory file system (None where it has none: the MPI library chooses)."""
    if not os.path.isdir(path):
        return None
    return shutil.disk_usage(path).free


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class NodeSum:
    """Sums over the members of ``comm``, every one of them on this node, through a window of theirs."""

    def __init__(self, comm: MPI.Intracomm, wait_mode: WaitMode) -> None:
        self.comm = comm
        self.size = comm.Get_size()
        self.index = comm.Get_rank()
        self.wait_mode = wait_mode
        self.capacity = 0                 # bytes of a member's slab
        self.window: MPI.Win | None = None
        self.segments: list[MPI.buffer] = []
        self.holder: object | None = None     # whose copies this member's slab holds (None: nobody's, or lost)
        self.commons: list[MPI.Win] = []      # windows of memory every member maps (``common``), kept for life

    @classmethod
    def open(cls, comm: MPI.Comm, wait_mode: WaitMode) -> NodeSum | None:
        """A ``NodeSum`` over ``comm``'s members on a communicator of its own; None (on every member) unless they
        all share this node. Collective over ``comm``."""
        from mpi4py import MPI as mpi

        shared = comm.Split_type(mpi.COMM_TYPE_SHARED, key=comm.Get_rank())
        together = comm.allreduce(int(shared.Get_size() == comm.Get_size()), op=mpi.MIN)
        if not together:
            shared.Free()
            return None
        return cls(cast("MPI.Intracomm", shared), wait_mode)   # split from a communicator of one node

    def barrier(self) -> None:
        """Meet the other members, every write to the window before visible after (MPI-3's unified-memory rule)."""
        windows = [w for w in (self.window, *self.commons) if w is not None]
        assert windows, "NodeSum.barrier before any window was made (reserve or common first)"
        for window in windows:
            window.Sync()
        MpiRequests([self.comm.Ibarrier()], self.wait_mode).wait()
        for window in windows:
            window.Sync()

    def window_bytes(self, nbytes: int) -> int:
        """Bytes of the whole window (every member's slab) for sums of ``nbytes``."""
        return self.size * _aligned(nbytes) if nbytes else 0

    def reserve(self, nbytes: int) -> bool:
        """Make the window hold sums of ``nbytes``, if the node has room for it; the same answer on every member
        (collective where the window must grow). False: the window stays as it was."""
        if nbytes <= self.capacity:
            return True
        if not self._has_room(self.window_bytes(nbytes) - self.window_bytes(self.capacity)):
            return False
        self._grow(nbytes)
        return True

    def common(self, dtype: torch.dtype, count: int) -> torch.Tensor | None:
        """``count`` elements of ``dtype`` in one memory every member maps (a window of its own, member 0's segment,
        kept for the process's life: a notebook's engine maps it once per model sharded), or None on every member
        where the node has no room for it. Its contents are unset; ``barrier`` orders writes to it. Collective."""
        from mpi4py import MPI as mpi

        nbytes = _aligned(count * torch.empty(0, dtype=dtype).element_size())
        if not self._has_room(nbytes):
            return None
        window = mpi.Win.Allocate_shared(nbytes if self.index == 0 else 0, 1, comm=self.comm)
        window.Lock_all(mpi.MODE_NOCHECK)
        self.commons.append(window)
        segment = window.Shared_query(0)[0]
        return torch.frombuffer(segment, dtype=dtype, count=count) if count else torch.empty(0, dtype=dtype)

    def _has_room(self, growth: int) -> bool:
        """Whether the node's shared-memory file system has ``ROOM_FACTOR`` times ``growth`` bytes free (member 0's
        reading, the same answer on every member; collective)."""
        room = self.comm.bcast(shm_room() if self.index == 0 else None, root=0)
        return room is None or room >= ROOM_FACTOR * growth

    def _grow(self, nbytes: int) -> None:
        from mpi4py import MPI as mpi

        self.holder = None
        if self.window is not None:
            self.window.Unlock_all()
            self.window.Free()
        slab = _aligned(nbytes)
        self.window = mpi.Win.Allocate_shared(slab, 1, comm=self.comm)
        self.window.Lock_all(mpi.MODE_NOCHECK)
        self.segments = [self.window.Shared_query(member)[0] for member in range(self.size)]
        self.capacity = slab

    def view(self, member: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        """Member ``member``'s slab as its first ``count`` elements of ``dtype``."""
        if count == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self.segments[member], dtype=dtype, count=count)

    def all_reduce(self, parts: Sequence[torch.Tensor]) -> None:
        """Replace every tensor of ``parts`` by its sum over the members, in place (as ``Context.all_reduce`` does,
        several tensors at once). Collective: every member passes parts of the same sizes and dtype (float32 or
        float64, CPU), after ``reserve`` of at least their bytes returned True."""
        dtype = parts[0].dtype if parts else torch.float32
        if dtype not in SUMMED_DTYPES or any(p.dtype != dtype or p.device.type != "cpu" for p in parts):
            raise ValueError(f"NodeSum sums CPU tensors of one dtype among {SUMMED_DTYPES}; got "
                             f"{sorted({(str(p.dtype), p.device.type) for p in parts})}")
        count = sum(p.numel() for p in parts)
        slab = self.slab(dtype, count)
        self.holder = None
        offset = 0
        for part in parts:
            self.write_peer_ranges(slab, count, offset, part.numel(), part)
            offset += part.numel()
        self.reduce_slab(parts)

    def bounds(self, count: int) -> list[int]:
        """Where each member's share of ``count`` summed elements starts (and, last, where the shares end)."""
        return [count * member // self.size for member in range(self.size + 1)]

    def peer_ranges(self, count: int, start: int, stop: int) -> list[tuple[int, int]]:
        """The parts of elements ``start:stop`` of a sum of ``count`` that lie outside this member's own share:
        what it writes into its slab for the others to add (its own share it adds from its tensors)."""
        bounds = self.bounds(count)
        own_low, own_high = bounds[self.index], bounds[self.index + 1]
        ranges = [(start, min(stop, own_low)), (max(start, own_high), stop)]
        return [(low, high) for low, high in ranges if low < high]

    def write_peer_ranges(self, slab: torch.Tensor, count: int, start: int, numel: int,
                          values: torch.Tensor | None) -> None:
        """Write ``values`` (elements ``start:start + numel`` of a sum of ``count``; None: zeros) into ``slab`` at
        their ``peer_ranges``: what the other members add to their shares."""
        flat = None if values is None else values.detach().reshape(-1)
        for low, high in self.peer_ranges(count, start, start + numel):
            target = slab[low:high]
            if flat is None:
                target.zero_()
            else:
                target.copy_(flat[low - start:high - start])

    def slab(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        """This member's slab as ``count`` elements of ``dtype``: ``reduce_slab`` adds its ``peer_ranges`` (the
        elements outside this member's share) to the others' shares; the share itself takes the sums. Write it only
        outside ``all_reduce``/``reduce_slab`` (a member still inside may be reading it), and claim it (``holder``)
        while its copies are yours: ``all_reduce`` and a growing window drop the claim."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if count * itemsize > self.capacity:
            raise ValueError(f"NodeSum holds sums of {self.capacity} bytes, not {count * itemsize}: reserve first")
        return self.view(self.index, dtype, count)

    def reduce_slab(self, parts: Sequence[torch.Tensor]) -> None:
        """``all_reduce(parts)`` where this member's slab already holds the parts, concatenated and flattened, at
        its ``peer_ranges`` (its own share is read from ``parts``; the sums are written into ``parts``).
        Collective."""
        if self.size == 1:
            return
        dtype = parts[0].dtype if parts else torch.float32
        count = sum(p.numel() for p in parts)
        bounds = self.bounds(count)
        own_low, own_high = bounds[self.index], bounds[self.index + 1]
        slabs = [self.view(member, dtype, count) for member in range(self.size)]
        self.barrier()                          # every slab written
        offset = 0
        for part in parts:                       # this member's share, part by part: the members' terms in rank order
            start, stop = offset, offset + part.numel()
            offset = stop
            low, high = max(start, own_low), min(stop, own_high)
            if low >= high:
                continue
            mine = part.detach().reshape(-1)[low - start:high - start]
            terms = [mine if member == self.index else slabs[member][low:high] for member in range(self.size)]
            out = slabs[self.index][low:high]
            torch.add(terms[0], terms[1], out=out)
            for term in terms[2:]:
                out.add_(term)
        self.barrier()                          # every share summed
        offset = 0
        for part in (p for p in parts if p.numel()):     # each part gathered from the shares it spans
            start, stop = offset, offset + part.numel()
            pieces = [(low, slabs[member][low:high]) for member in range(self.size)
                      for low, high in [(max(start, bounds[member]), min(stop, bounds[member + 1]))] if low < high]
            target = part.detach()
            if len(pieces) == 1 or not target.is_contiguous():
                whole = pieces[0][1] if len(pieces) == 1 else torch.cat([piece for _, piece in pieces])
                target.copy_(whole.view(part.shape))
            else:
                flat = target.view(-1)
                for low, piece in pieces:
                    flat[low - start:low - start + piece.numel()].copy_(piece)
            offset = stop


@runtime_checkable
class NodeSums(Protocol):
    """A context that can sum over a group through its node's shared memory (``Context.node_sum``)."""

    def node_sum(self, group: Group | None = None) -> NodeSum | None: ...
