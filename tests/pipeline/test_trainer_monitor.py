"""Monitoring costs a training step no work per action: the monitor reads the action under way at its heartbeats."""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.data import Batcher
from mpi4dl_nb.data.synthetic import SyntheticDataset
from mpi4dl_nb.run.monitor import JobMonitor
from mpi4dl_nb.run.trainer import Trainer, TrainSettings
from tests.support.models import build

STEPS = 3


class CountingMonitor(JobMonitor):
    """A one-rank monitor (no socket, no thread) counting the calls made to it."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx, [], None)
        self.calls: Counter[str] = Counter()

    def begin_step(self, step: int) -> None:
        self.calls["begin_step"] += 1
        super().begin_step(step)

    def progress(self, action: str = "") -> None:
        self.calls["progress"] += 1
        super().progress(action)

    def arm(self, timeout: float | None) -> None:
        self.calls["arm"] += 1
        super().arm(timeout)


def engine(ctx, parts: int) -> dl.HybridEngine:
    torch.manual_seed(0)
    config = dl.ParallelConfig(split_size=1, spatial_size=0, parts=parts, schedule="1f1b")
    return dl.HybridEngine(build("resnet"), config, ctx, loss_fn=nn.CrossEntropyLoss())


def trainer(ctx, parts: int, monitor: JobMonitor | None) -> Trainer:
    batcher = Batcher(SyntheticDataset(16, num_classes=5, num_samples=32), 8)
    return Trainer(engine(ctx, parts), batcher, ctx, TrainSettings(steps=STEPS, progress=False, dtype=torch.float64),
                   monitor=monitor)


def hooks_passed(train: Trainer) -> list[object]:
    """Run ``train`` and return the ``on_action`` hook each step handed the engine."""
    hooks: list[object] = []
    step = train.engine.train_step

    def recording(images, labels, on_action=None, **kwargs):
        hooks.append(on_action)
        return step(images, labels, on_action, **kwargs)

    train.engine.train_step = recording
    train.run()
    return hooks


def test_monitor_calls_per_step_do_not_grow_with_the_actions():
    ctx = dl.init()
    counted = {}
    for parts in (2, 8):
        monitor = CountingMonitor(ctx)
        train = trainer(ctx, parts, monitor)
        assert hooks_passed(train) == [None] * STEPS      # no guard, no step-through: no per-action callback
        counted[parts] = monitor.calls
    actions = {parts: len(engine(ctx, parts).schedule.actions(0)) for parts in counted}
    assert actions[8] > actions[2] + 10, actions
    assert counted[2] == counted[8], counted                # the same calls, 4x the micro-batches
    # per step: at most the step's own progress and the wait for its read-ahead input ("waiting for input")
    assert counted[8]["progress"] <= 2 * STEPS and counted[8]["begin_step"] == STEPS, counted[8]


def test_the_monitor_reads_the_action_under_way_at_its_heartbeat():
    ctx = dl.init()
    monitor = CountingMonitor(ctx)
    train = trainer(ctx, 2, monitor)
    x, y = torch.randn(8, 3, 16, 16, dtype=torch.float64), torch.randint(0, 5, (8,))
    monitor.begin_step(1)
    train.engine.start_step(x, y)
    first, second = train.engine.schedule.actions(0)[:2]
    monitor._beat(100.0)
    assert (monitor.action, monitor.last_progress) == (first.describe(), 100.0)
    monitor._beat(101.0)                                    # no new action: no progress
    assert monitor.last_progress == 100.0
    train.engine.advance()
    monitor._beat(102.0)
    assert (monitor.action, monitor.last_progress) == (second.describe(), 102.0)
    train.engine.finish_step()
    monitor._beat(103.0)                                    # no step under way: the last action stays
    assert (monitor.action, monitor.last_progress) == (second.describe(), 102.0)
