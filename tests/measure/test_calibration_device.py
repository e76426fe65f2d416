"""Calibration on a GPU's data plane, faked on CPU: its reductions on the plane's device (the nccl plane refuses
host tensors), and the ping-pong timed once the device's queued transfers are done (on NCCL ``wait()`` only orders
the stream: a host clock read right after it measures the launch)."""

from __future__ import annotations

import types

import pytest
import torch

from mpi4dl_nb.comm.torch_plane import TorchPlane
from mpi4dl_nb.measure import calibration
from mpi4dl_nb.measure.calibration import meeting_cost, ping_pong

LATENCY, BANDWIDTH = 20e-6, 10e9     # seconds, bytes per second of the faked link


class _DeviceClock:
    """A host clock that sees a transfer's time only once the device is synchronized."""

    def __init__(self) -> None:
        self.now = 0.0
        self.queued = 0.0
        self.synchronized = 0

    def perf_counter(self) -> float:
        return self.now

    def synchronize(self, device: torch.device) -> None:
        self.now, self.queued = self.now + self.queued, 0.0
        self.synchronized += 1


class _NcclRank:
    """Rank 0 of 2 on a faked nccl plane: tensors on ``meta`` (standing for the GPU), host tensors refused by the
    torch plane's own check; p2p only queues its time on the device clock."""

    def __init__(self, clock: _DeviceClock) -> None:
        self.rank, self.world_size, self.device = 0, 2, torch.device("meta")
        self.plane = TorchPlane.__new__(TorchPlane)
        self.plane.backend, self.plane.device = "nccl", self.device
        self.clock = clock
        self.reduced: list[torch.Tensor] = []

    def _queue(self, tensor: torch.Tensor) -> None:
        self.plane._check(tensor)
        self.clock.queued += LATENCY + tensor.numel() * tensor.element_size() / BANDWIDTH

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._queue(tensor)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        self._queue(tensor)
        return tensor

    def all_reduce(self, tensor: torch.Tensor, group: object = None) -> torch.Tensor:
        self.plane._check(tensor)
        self.reduced.append(tensor)
        return torch.full(tensor.shape, 1e-4, dtype=tensor.dtype)   # the sum, read back to the host

    def new_group(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        return ranks

    def barrier(self, group: object = None) -> None:
        return None

    def bcast_object(self, obj: object, root: int = 0, group: object = None) -> object:
        return obj


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> _DeviceClock:
    clock = _DeviceClock()
    monkeypatch.setattr(calibration, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(calibration, "synchronize", clock.synchronize, raising=False)
    return clock


def test_the_ping_pong_is_timed_once_the_transfers_are_done(clock: _DeviceClock) -> None:
    sizes = (1024, 1 << 20)
    points = ping_pong(_NcclRank(clock), sizes=sizes, repeats=3)   # type: ignore[arg-type]
    assert [size for size, _ in points] == list(sizes)
    for size, seconds in points:        # one way: the link's latency and bytes, not the launch's zero
        assert seconds == pytest.approx(LATENCY + size / BANDWIDTH)
    assert clock.synchronized == 2 * 4 * len(sizes)


def test_meeting_cost_reduces_on_the_planes_device(clock: _DeviceClock) -> None:
    rank = _NcclRank(clock)
    cost = meeting_cost(rank, rounds=2, work_seconds=1e-5, repeats=1)   # type: ignore[arg-type]
    assert cost >= 0.0 and rank.reduced and all(t.device == rank.device for t in rank.reduced)
