"""The ``mpi`` data plane: mpi4py on the tensors' own memory (zero-copy on CPU, CUDA-aware MPI or staging on GPU)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from .cuda_aware import cuda_aware_mpi
from .device import settle
from .handles import Channel, Group, Request, Transfer
from .staging import PinnedPool
from .waiting import WaitMode, poll

if TYPE_CHECKING:
    from mpi4py import MPI
    from mpi4py.typing import Buffer
    from torch.distributed import ProcessGroup

# ``mpi4py.MPI`` is imported where it is first used, never at module import: importing it starts MPI
__all__ = ["MpiPlane", "MpiRequests", "cuda_aware_mpi"]

class MpiRequests:
    """mpi4py requests completed together: by ``Waitall`` (``WaitMode.BLOCK``) or by
    ``Testall`` and short sleeps (``WaitMode.YIELD``: the core goes to ranks that compute)."""

    def __init__(self, handles: Sequence[MPI.Request], mode: WaitMode) -> None:
        self.handles = list(handles)
        self.mode = mode

    def wait(self) -> None:
        if self.mode is WaitMode.YIELD:
            poll(lambda: all(handle.Test() for handle in self.handles))
        else:
            for handle in self.handles:
                handle.Wait()

    def test(self) -> bool:
        """Whether every request has completed; drives MPI's progress once and never blocks."""
        return all(handle.Test() for handle in self.handles)


class MpiPlane:
    """Tensors travel through mpi4py, on the tensors' own memory.

    CPU tensors go zero-copy (a NumPy view; bfloat16 as int16 bits). CUDA tensors go
    directly when the MPI library is CUDA-aware (MVAPICH2-GDR, CUDA-aware Open MPI; mpi4py
    reads ``__cuda_array_interface__``; collectives blocking there), else they are staged through host buffers of a
    reusable ``PinnedPool`` (no new pinned buffer per message).

    MPI works outside CUDA's stream order, so before device memory (a tensor, or a host
    buffer an asynchronous device-to-host copy is filling) is handed to MPI, the current
    stream is waited for (``device.settle``): an ``Isend`` right after an asynchronous
    ``copy_`` into a halo buffer must not read the buffer before the kernel wrote it, and
    an ``Irecv`` must not write memory a queued kernel still reads. One wait per exchange
    or collective. ``staging=True`` stages every tensor, CPU ones too (tests use it to run
    the GPU's staged path on CPU).
    """

    name = "mpi"

    def __init__(self, comm: MPI.Comm, device: torch.device, *, staging: bool = False,
                 pool: PinnedPool | None = None, wait_mode: WaitMode = WaitMode.BLOCK) -> None:
        self.comm = comm
        self.wait_mode = wait_mode
        self.cuda_aware = device.type == "cuda" and cuda_aware_mpi()
        self.stage_everything = staging
        self.pool = PinnedPool() if pool is None else pool
        self.settles = 0   # stream waits so far (each before MPI touched device memory)

    # ---------------------------------------------------------------- buffers
    def _buffer(self, tensor: torch.Tensor) -> Buffer:
        """The memory mpi4py reads/writes: the tensor's own where possible."""
        if tensor.device.type == "cpu":
            if tensor.dtype == torch.bfloat16:
                return tensor.detach().view(torch.int16).numpy()
            return tensor.detach().numpy()
        return tensor.detach()   # CUDA-aware MPI: mpi4py reads __cuda_array_interface__

    def _staged(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` goes through a host buffer (CUDA without CUDA-aware MPI)."""
        return self.stage_everything or (tensor.device.type == "cuda" and not self.cuda_aware)

    @staticmethod
    def _on_device(tensor: torch.Tensor) -> bool:
        """Whether kernels of a stream may still be writing or reading ``tensor``'s memory."""
        return tensor.device.type == "cuda"

    def _settle(self, tensors: Sequence[torch.Tensor]) -> None:
        """Wait once for the current stream of every device among ``tensors``."""
        devices = {t.device for t in tensors if self._on_device(t)}
        for device in devices:
            settle(device)
        self.settles += bool(devices)

    # ------------------------------------------------------------ point to point
    def exchange(self, transfers: Sequence[Transfer], via: Group | Channel | None) -> Request:
        """Post every transfer (tags keep them apart: the world communicator carries all p2p)."""
        if not any(self._staged(t.tensor) or self._on_device(t.tensor) for t in transfers):
            return self._exchange_host(transfers)   # host memory: nothing to stage or settle
        staged = {i: self.pool.take(t.tensor) for i, t in enumerate(transfers) if self._staged(t.tensor)}
        for i, host in staged.items():
            if transfers[i].send:
                host.copy_(transfers[i].tensor.detach(), non_blocking=True)
        self._settle([t.tensor for t in transfers])
        handles = []
        for i, t in enumerate(transfers):
            buffer = self._buffer(staged.get(i, t.tensor))
            handles.append(self.comm.Isend(buffer, t.peer, t.tag) if t.send
                           else self.comm.Irecv(buffer, t.peer, t.tag))

        def done() -> None:
            for i, host in staged.items():
                if not transfers[i].send:
                    transfers[i].tensor.detach().copy_(host)   # blocking: the buffer is reused next
                self.pool.give(host)
        return Request(MpiRequests(handles, self.wait_mode), on_done=done if staged else None,
                       keep=[t.tensor for t in transfers])

    def _exchange_host(self, transfers: Sequence[Transfer]) -> Request:
        """``exchange`` of host tensors: posted on their own memory, nothing to do on completion."""
        comm = self.comm
        handles = [comm.Isend(self._buffer(t.tensor), t.peer, t.tag) if t.send
                   else comm.Irecv(self._buffer(t.tensor), t.peer, t.tag) for t in transfers]
        return Request(MpiRequests(handles, self.wait_mode), keep=[t.tensor for t in transfers])

    # --------------------------------------------------------------- collectives
    def _in_place(self, tensor: torch.Tensor, blocking: Callable[[Buffer], None],
                  posted: Callable[[Buffer], MPI.Request]) -> None:
        """Run the in-place collective on ``tensor`` (staged if needed): ``blocking`` on device memory (CUDA-aware
        MPIs take device buffers in blocking collectives only: Open MPI's FAQ), else ``posted`` (non-blocking)
        completed in this plane's wait mode."""
        if not self._staged(tensor):
            self._settle([tensor])
            if self._on_device(tensor):
                blocking(self._buffer(tensor))
                return
            MpiRequests([posted(self._buffer(tensor))], self.wait_mode).wait()
            return
        host = self.pool.take(tensor)
        try:
            host.copy_(tensor.detach(), non_blocking=True)
            self._settle([tensor])
            MpiRequests([posted(self._buffer(host))], self.wait_mode).wait()
            tensor.detach().copy_(host)
        finally:
            self.pool.give(host)

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> None:
        from mpi4py import MPI

        comm = group.communicator()
        self._in_place(tensor, lambda buffer: comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM),
                       lambda buffer: comm.Iallreduce(MPI.IN_PLACE, buffer, op=MPI.SUM))

    def iall_reduce(self, tensor: torch.Tensor, group: Group) -> Request:
        """``MPI_Iallreduce`` in place on ``tensor`` (through a host buffer when staged), left pending:
        MPI progresses it whenever this rank calls MPI (``Request.test`` does so without waiting). On device
        memory (CUDA-aware MPI) a blocking ``MPI_Allreduce``, done on return."""
        from mpi4py import MPI

        comm = group.communicator()
        if not self._staged(tensor) and self._on_device(tensor):
            self.all_reduce(tensor, group)
            return Request.completed()
        if not self._staged(tensor):
            handle = comm.Iallreduce(MPI.IN_PLACE, self._buffer(tensor), op=MPI.SUM)
            return Request(MpiRequests([handle], self.wait_mode), keep=tensor)
        host = self.pool.take(tensor)
        host.copy_(tensor.detach(), non_blocking=True)
        self._settle([tensor])
        handle = comm.Iallreduce(MPI.IN_PLACE, self._buffer(host), op=MPI.SUM)

        def done() -> None:
            tensor.detach().copy_(host)
            self.pool.give(host)
        return Request(MpiRequests([handle], self.wait_mode), on_done=done, keep=tensor)

    def _into(self, source: torch.Tensor, out: torch.Tensor, blocking: Callable[[Buffer, Buffer], None],
              posted: Callable[[Buffer, Buffer], MPI.Request]) -> None:
        """Run a collective reading ``source`` and writing ``out`` (both staged if needed): ``blocking`` on device
        memory (as ``_in_place``), else ``posted`` completed in this plane's wait mode."""
        if not (self._staged(source) or self._staged(out)):
            self._settle([source, out])
            if self._on_device(source) or self._on_device(out):
                blocking(self._buffer(source), self._buffer(out))
                return
            MpiRequests([posted(self._buffer(source), self._buffer(out))], self.wait_mode).wait()
            return
        host_source, host_out = self.pool.take(source), self.pool.take(out)
        try:
            host_source.copy_(source.detach(), non_blocking=True)
            self._settle([source, out])
            MpiRequests([posted(self._buffer(host_source), self._buffer(host_out))], self.wait_mode).wait()
            out.detach().copy_(host_out)
        finally:
            self.pool.give(host_source)
            self.pool.give(host_out)

    def reduce_scatter(self, flat: torch.Tensor, out: torch.Tensor, counts: Sequence[int], group: Group) -> None:
        """``MPI_Reduce_scatter`` (sum; the members' pieces of ``counts``, uneven allowed) into ``out``."""
        from mpi4py import MPI

        comm, sizes = group.communicator(), list(counts)
        self._into(flat, out, lambda send, recv: comm.Reduce_scatter(send, recv, sizes, op=MPI.SUM),
                   lambda send, recv: comm.Ireduce_scatter(send, recv, sizes, op=MPI.SUM))

    def all_gather(self, piece: torch.Tensor, out: torch.Tensor, counts: Sequence[int], group: Group) -> None:
        """``MPI_Allgatherv``: every member's ``piece`` (``counts`` elements each, uneven allowed) into ``out``."""
        comm, sizes = group.communicator(), list(counts)
        self._into(piece, out, lambda send, recv: comm.Allgatherv(send, [recv, sizes]),
                   lambda send, recv: comm.Iallgatherv(send, [recv, sizes]))

    def broadcast(self, tensor: torch.Tensor, root: int, group: Group) -> None:
        comm, index = group.communicator(), group.rank_of(root)
        self._in_place(tensor, lambda buffer: comm.Bcast(buffer, root=index),
                       lambda buffer: comm.Ibcast(buffer, root=index))

    # -------------------------------------------------------------------- groups
    def process_group(self, ranks: Sequence[int] | None) -> ProcessGroup | None:
        return None   # groups live in the MPI communicators the Context makes

    def channel_group(self, src: int, dst: int) -> ProcessGroup | None:
        return None   # p2p shares the world communicator; tags keep the messages apart

    def close(self) -> None:
        """Nothing to tear down: the MPI world belongs to the process."""
