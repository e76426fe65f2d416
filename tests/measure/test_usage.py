"""Metrics behind the CLI's JSON line: counted activation/state memory, communication time, progress bar."""
from __future__ import annotations

import torch
from torch import nn

from mpi4dl_nb.comm.trace import Event
from mpi4dl_nb.measure.usage import ActivationMeter, RunMetrics, comm_seconds, is_communication, state_bytes


def test_activation_meter_counts_saved_tensors_once_and_releases_them():
    conv = nn.Conv2d(2, 4, 3, padding=1, bias=False).double()
    meter = ActivationMeter(exclude=list(conv.parameters()))
    x = torch.randn(3, 2, 16, 16, dtype=torch.float64, requires_grad=True)
    with meter:
        y = conv(x)          # saves its input (weight excluded)
        z = (y * y).sum()    # saves y (twice: both factors are the same storage)
    assert meter.current == x.numel() * 8 + y.numel() * 8
    assert meter.peak == meter.current
    z.backward()
    assert meter.current == 0 and meter.peak == x.numel() * 8 + y.numel() * 8
    with meter:
        out = torch.relu(conv(x)).sum()
    assert meter.peak == x.numel() * 8 + y.numel() * 8     # peak kept; smaller second pass
    del out


def test_state_bytes_counts_parameters_gradients_and_optimizer_state():
    layer = nn.Linear(10, 5)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    params = 10 * 5 + 5
    assert state_bytes(layer.parameters(), opt) == params * 4
    layer(torch.randn(2, 10)).sum().backward()
    opt.step()                                   # gradients + momentum buffers now exist
    assert state_bytes(layer.parameters(), opt) == 3 * params * 4
    bn = nn.BatchNorm2d(3)
    assert state_bytes(bn.parameters(), None, bn.buffers()) == 6 * 4 + 6 * 4 + 8


def test_comm_seconds_merges_overlapping_communication():
    events = [Event(0, "F", 0.0, 1.0), Event(0, "halo", 0.2, 0.4), Event(0, "SEND_ACT", 1.0, 1.5),
              Event(0, "RECV_GRAD", 1.4, 2.0), Event(0, "ALLREDUCE", 3.0, 3.25), Event(0, "OPTIM", 3.25, 4.0)]
    assert abs(comm_seconds(events) - (0.2 + 1.0 + 0.25)) < 1e-12
    assert [is_communication(e.op) for e in events] == [False, True, True, True, True, False]


def test_run_metrics_split_compute_and_comm():
    m = RunMetrics()
    m.add_step(4, seconds=2.0, comm=0.5, loss=1.0)
    m.add_step(4, seconds=1.0, comm=3.0, loss=0.5)          # comm capped at the step time
    assert m.images == 8 and m.comm_seconds == 1.5 and m.compute_seconds == 1.5
    assert m.step_seconds == [2.0, 1.0] and m.losses == [1.0, 0.5]
    assert m.seconds_after(1) == 1.0 and m.seconds_after(0) == 3.0 and m.last_loss == 0.5


def test_run_metrics_keep_constant_memory_over_long_runs():
    m = RunMetrics(keep=10)
    for step in range(10_000):
        m.add_step(2, seconds=1.0 + (step == 0), comm=0.25, loss=float(step))
    assert m.steps == 10_000 and m.images == 20_000 and m.seconds == 10_001.0
    assert m.losses == [float(s) for s in range(9_990, 10_000)] and len(m.step_seconds) == 10
    assert m.seconds_after(1) == 9_999.0 and m.comm_seconds == 2_500.0
