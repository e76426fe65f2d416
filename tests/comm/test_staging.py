"""Host staging: the pinned-buffer pool is reused across messages, and the mpi plane's staged and
device paths (run on CPU with staging forced / device memory faked) wait for the stream before MPI."""

from __future__ import annotations

import pytest
import torch

from mpi4dl_nb.comm.handles import Group, Transfer
from mpi4dl_nb.comm.mpi_plane import MpiPlane
from mpi4dl_nb.comm.staging import MIN_BUFFER, PinnedPool, size_class
from mpi4dl_nb.comm.waiting import WaitMode


def test_size_classes_are_powers_of_two():
    assert [size_class(n) for n in (0, 1, 4096, 4097, 10_000, 1 << 20)] == \
        [MIN_BUFFER, MIN_BUFFER, 4096, 8192, 16384, 1 << 20]


def test_pool_lends_shaped_views_and_reuses_buffers():
    pool = PinnedPool(pin=False)
    like = torch.zeros(3, 5, dtype=torch.float64)
    a = pool.take(like)
    assert a.shape == (3, 5) and a.dtype == torch.float64 and pool.lent == 1
    b = pool.take(torch.zeros(7, dtype=torch.bfloat16))     # a second buffer while a is lent
    assert pool.created == 2
    pool.give(a)
    pool.give(b)
    for step in range(100):                                 # many messages, no new buffer
        views = [pool.take(torch.zeros(10 + step % 7, dtype=torch.float32)), pool.take(like)]
        for view in views:
            view.fill_(step)
            pool.give(view)
    assert pool.created == 2 and pool.lent == 0 and pool.held_bytes == 2 * MIN_BUFFER
    with pytest.raises(ValueError, match="did not lend"):
        pool.give(torch.zeros(2))


class _Recorder:
    """An mpi4py communicator stand-in logging calls; requests complete at once (loopback)."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.sent: list = []

    def Isend(self, buffer, dest, tag):
        self.log.append(("Isend", dest, tag))
        self.sent.append(buffer.copy())
        return _Done()

    def Irecv(self, buffer, source, tag):
        self.log.append(("Irecv", source, tag))
        buffer[...] = self.sent.pop(0)
        return _Done()

    def Iallreduce(self, flag, buffer, op):
        self.log.append(("Iallreduce",))
        buffer *= 2          # a world of two equal ranks
        return _Done()

    def Ibcast(self, buffer, root):
        self.log.append(("Ibcast", root))
        return _Done()

    def Allreduce(self, flag, buffer, op):
        self.log.append(("Allreduce",))
        buffer *= 2

    def Bcast(self, buffer, root):
        self.log.append(("Bcast", root))


class _Done:
    """A request that completed at once (both ways of waiting ask it)."""

    def Wait(self):
        return None

    def Test(self):
        return True


class _DevicePlane(MpiPlane):
    """The mpi plane treating every tensor as device memory, its stream waits logged."""

    def __init__(self, log: list, staging: bool) -> None:
        super().__init__(_Recorder(log), torch.device("cpu"), staging=staging, pool=PinnedPool(pin=False))
        self.log = log

    @staticmethod
    def _on_device(tensor):
        return True

    def _settle(self, tensors):
        self.log.append(("settle",))
        super()._settle(tensors)


@pytest.mark.parametrize("mode", list(WaitMode))
@pytest.mark.parametrize("staging", [False, True], ids=["cuda-aware", "staged"])
def test_mpi_plane_waits_for_the_stream_before_mpi_touches_device_memory(staging, mode):
    log: list = []
    plane = _DevicePlane(log, staging)
    plane.wait_mode = mode
    group = Group((0, 1), mpi_comm=plane.comm)
    data = torch.arange(6, dtype=torch.float64)
    got = torch.zeros(6, dtype=torch.float64)
    plane.exchange([Transfer.to(data, 1, 7), Transfer.into(got, 1, 7)], None).wait()
    assert torch.equal(got, data)
    plane.all_reduce(got, group)
    assert torch.equal(got, 2 * data)
    plane.broadcast(got, 1, group)
    collectives = [("Iallreduce",), ("Ibcast", 1)] if staging else [("Allreduce",), ("Bcast", 1)]   # blocking on device
    assert log == [("settle",), ("Isend", 1, 7), ("Irecv", 1, 7), ("settle",), collectives[0],
                   ("settle",), collectives[1]]
    assert plane.settles == 3
    if staging:   # one buffer per message in flight, all back in the pool, reused next time
        assert plane.pool.lent == 0 and plane.pool.created == 2
        plane.exchange([Transfer.to(data, 1, 7), Transfer.into(got, 1, 7)], None).wait()
        assert plane.pool.created == 2


def test_cpu_tensors_skip_the_stream_wait():
    log: list = []
    plane = MpiPlane(_Recorder(log), torch.device("cpu"), pool=PinnedPool(pin=False))
    plane.exchange([Transfer.to(torch.ones(2), 1), Transfer.into(torch.zeros(2), 1)], None).wait()
    assert plane.settles == 0 and plane.pool.created == 0 and log == [("Isend", 1, 0), ("Irecv", 1, 0)]
