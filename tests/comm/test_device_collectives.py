"""Collectives on device memory through a CUDA-aware MPI: blocking ones only (Open MPI takes device buffers in
point-to-point and blocking collectives, not in non-blocking ones), non-blocking ones on host memory; and the
pinned staging pool bounded, the least recently returned buffer freed first."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpi4dl_nb.comm.handles import Group
from mpi4dl_nb.comm.mpi_plane import MpiPlane
from mpi4dl_nb.comm.staging import MIN_BUFFER, PinnedPool


class _Done:
    def Wait(self) -> None:
        return None

    def Test(self) -> bool:
        return True


class _CudaAwareOpenMpi:
    """A communicator of two equal ranks whose non-blocking collectives refuse device buffers."""

    def __init__(self, device_memory: bool) -> None:
        self.device_memory = device_memory
        self.calls: list[str] = []

    def _posted(self, name: str) -> _Done:
        if self.device_memory:
            raise RuntimeError(f"{name} on device memory: this MPI reduces it on the host through a device pointer")
        self.calls.append(name)
        return _Done()

    def Iallreduce(self, flag: object, buffer: np.ndarray, op: object) -> _Done:
        buffer *= 2
        return self._posted("Iallreduce")

    def Ibcast(self, buffer: np.ndarray, root: int) -> _Done:
        return self._posted("Ibcast")

    def Allreduce(self, flag: object, buffer: np.ndarray, op: object) -> None:
        buffer *= 2
        self.calls.append("Allreduce")

    def Bcast(self, buffer: np.ndarray, root: int) -> None:
        self.calls.append("Bcast")


class _DeviceMemoryPlane(MpiPlane):
    """The mpi plane on a CUDA-aware MPI with every tensor taken for device memory."""

    @staticmethod
    def _on_device(tensor: torch.Tensor) -> bool:
        return True


@pytest.mark.parametrize("device_memory", [True, False], ids=["device", "host"])
def test_collectives_on_device_memory_are_blocking_on_host_memory_posted(device_memory: bool) -> None:
    comm = _CudaAwareOpenMpi(device_memory)
    kind = _DeviceMemoryPlane if device_memory else MpiPlane
    plane = kind(comm, torch.device("cpu"), pool=PinnedPool(pin=False))   # type: ignore[arg-type]
    group = Group((0, 1), mpi_comm=comm)   # type: ignore[arg-type]
    values = torch.arange(4, dtype=torch.float64)
    plane.all_reduce(values, group)
    plane.iall_reduce(values, group).wait()
    plane.broadcast(values, 1, group)
    assert torch.equal(values, 4 * torch.arange(4, dtype=torch.float64))
    assert comm.calls == (["Allreduce", "Allreduce", "Bcast"] if device_memory else
                          ["Iallreduce", "Iallreduce", "Ibcast"])
    assert plane.pool.created == 0


def test_the_pinned_pool_keeps_at_most_its_cap_freeing_the_least_recently_returned() -> None:
    pool = PinnedPool(pin=False, cap_bytes=4 * MIN_BUFFER)
    small, large = torch.zeros(MIN_BUFFER // 4), torch.zeros(MIN_BUFFER // 2)     # 1 and 2 buffers' worth
    a, b = pool.take(small), pool.take(large)
    pool.give(b)
    pool.give(a)                                   # held: 3 buffers' worth, under the cap
    assert pool.held_bytes == 3 * MIN_BUFFER and pool.freed == 0
    c = pool.take(torch.zeros(MIN_BUFFER))         # 4 buffers' worth more, lent: it stays lent
    assert pool.held_bytes == 7 * MIN_BUFFER
    pool.give(c)                                   # over the cap: the oldest free buffers go first (b, then a)
    assert pool.freed == 2 and pool.held_bytes == 4 * MIN_BUFFER and pool.lent == 0
    again = pool.take(torch.zeros(MIN_BUFFER))     # the most recent stays reusable
    assert pool.created == 3
    pool.give(again)
    for _ in range(50):                            # many messages, bounded and no new buffer
        pool.give(pool.take(small))
    assert pool.held_bytes <= 4 * MIN_BUFFER and pool.created == 4
