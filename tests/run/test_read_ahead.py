"""``train --read-ahead N`` (issue 64): the next step's input read on a worker thread while a step computes. The
engine gets the very batches it reads inline (float64, bitwise: across an epoch end, with accumulation and
augmentation), from a resumed step on; the worker reads at most N steps ahead; its error is raised at the step that
needed the batch, with its message; no thread outlives the run (its end, an error, an early stop); the summary
reports each rank's ``input_wait_seconds``."""

from __future__ import annotations

import threading
import time
import traceback

import pytest
import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.data import Batcher
from mpi4dl_nb.data.augment import AugmentSpec
from mpi4dl_nb.data.read_ahead import ReadAhead
from mpi4dl_nb.data.synthetic import SyntheticDataset
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.run.job import TrainJob
from mpi4dl_nb.run.trainer import Trainer, TrainSettings
from tests.support.models import build

WORKER = "mpi4dl-read-ahead"
IMAGE = 16
FAILING = 5          # the image whose read fails


class Recorded(SyntheticDataset):
    """Synthetic images whose reads are logged (index, thread), one of them failing, each slowed if asked."""

    def __init__(self, fail: int | None = None, sleep: float = 0.0) -> None:
        super().__init__(IMAGE, num_classes=5, num_samples=6)
        self.fail, self.sleep = fail, sleep
        self.log: list[tuple[int, str]] = []

    def read(self, index: int, box: object = None) -> torch.Tensor:
        self.log.append((index, threading.current_thread().name))
        time.sleep(self.sleep)
        if index == self.fail:
            raise OSError(f"region of image {index} unreadable")
        return super().read(index, box)   # type: ignore[arg-type]


def trainer(data: Recorded, read_ahead: int, steps: int = 4) -> Trainer:
    """2 micro-batches of 2 float64 images per batch, 2 batches per step (an epoch of 3 batches: the second step
    spans an epoch end), flips, turns and colour jitter."""
    engine = dl.HybridEngine(build("resnet"), dl.ParallelConfig(split_size=1, spatial_size=0, parts=2), dl.init(),
                             loss_fn=nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    batcher = Batcher(data, 2, seed=1, augment=AugmentSpec.parse("flip,rot90,color"))
    settings = TrainSettings(steps=steps, progress=False, dtype=torch.float64, accumulate=2, read_ahead=read_ahead)
    return Trainer(engine, batcher, engine.ctx, settings)


def workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WORKER]


def test_read_ahead_trains_on_the_batches_read_inline_bitwise():
    runs = {}
    for ahead in (0, 1):
        data = Recorded()
        run = trainer(data, ahead)
        summary = run.run()
        assert summary is not None and not workers()
        weights = [p.detach().clone() for inst in run.engine.instances.values() for p in inst.canonical.parameters()]
        runs[ahead] = (summary.losses, weights, data.log, run)
    (inline, inline_weights, inline_log, _), (ahead, ahead_weights, ahead_log, read) = runs[0], runs[1]
    assert ahead == inline and all(torch.equal(a, b) for a, b in zip(ahead_weights, inline_weights))
    assert [i for i, _ in ahead_log] == [i for i, _ in inline_log]          # the same reads, in the same order
    assert {t for _, t in inline_log} == {"MainThread"} and {t for _, t in ahead_log} == {WORKER}
    assert read.reads.misses == 0          # every read the engine made was one read ahead


def test_a_resumed_run_reads_ahead_from_its_step_and_a_batch_read_ahead_equals_one_read_inline():
    data = Recorded()
    run = trainer(data, 1, steps=5)
    loaded: list[int] = []
    read_step = run.read_step
    run.read_step = lambda step: loaded.append(step) or read_step(step)   # type: ignore[method-assign]
    run.step = 3                                    # as restore() leaves a resumed run
    run.run()
    assert loaded == [3, 4]
    for position in run.positions(1):               # the epoch end: batches (0, 2) and (1, 0)
        ahead, inline = run.reads.batch(position, run.reads.ahead(position)), run.reads.batch(position)
        for rows, box in run.reads.image_reads:
            assert ahead[0] is not None and inline[0] is not None
            a, b = ahead[0](rows, box), inline[0](rows, box)
            assert isinstance(a, torch.Tensor) and a.dtype == torch.float64 and torch.equal(a, b)
        assert ahead[1] is not None and torch.equal(ahead[1], inline[1])


def test_a_failed_read_is_raised_at_the_step_that_needed_it_and_no_thread_is_left():
    run = trainer(Recorded(fail=FAILING), 1)
    needs = [s for s in range(4) if any(FAILING in run.batcher.indices(*p) for p in run.positions(s))]
    assert needs and needs[0] > 0, "the test wants a step before the failing read"
    with pytest.raises(OSError, match=f"region of image {FAILING} unreadable") as raised:
        run.run()
    assert run.step == needs[0]                     # every step before it trained, on the worker's reads
    assert "_run" in [frame.name for frame in traceback.extract_tb(raised.value.__traceback__)]   # the worker's
    assert not workers() and run.read_ahead is None


def test_an_error_of_the_step_stops_the_worker():
    run = trainer(Recorded(), 1, steps=4)
    calls = []

    def failing(*args: object, **kwargs: object) -> float:
        calls.append(1)
        raise RuntimeError("the step failed")
    run.engine.train_accumulated = failing          # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="the step failed"):
        run.run()
    assert calls == [1] and not workers()


def test_the_worker_reads_at_most_depth_ahead_and_stops_when_closed_early():
    for depth in (1, 2):
        loaded: list[int] = []
        ahead = ReadAhead(range(10), lambda item, loaded=loaded: loaded.append(item) or item * 10, depth)
        assert ahead.take() == (0, 0)
        deadline = time.monotonic() + 5
        while len(loaded) < 1 + depth and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)
        assert loaded == list(range(1 + depth))     # the one taken and ``depth`` more, no further
        ahead.close()                               # an early stop: the worker waits for a slot, wakes, ends
        assert not ahead.alive and ahead.take() is None
    started, release = threading.Event(), threading.Event()

    def slow(item: int) -> int:
        started.set()
        release.wait(5)
        return item
    ahead = ReadAhead(range(3), slow)
    started.wait(5)
    threading.Timer(0.05, release.set).start()
    ahead.close()                                   # stopped during a load: joined once it ends
    assert not ahead.alive


def test_a_slow_reader_s_wait_is_reported_per_rank_and_left_out_of_compute():
    data = Recorded(sleep=0.01)
    run = trainer(data, 0, steps=2)
    record = run.run().as_dict()                    # type: ignore[union-attr]
    wait, = record["input_wait_seconds"]
    assert len(data.log) == 2 * 2 * 2 and wait >= len(data.log) * 0.01   # steps x batches x images, 10 ms each
    compute, comm, total = record["compute_seconds"][0], record["comm_seconds"][0], record["train_seconds"][0]
    assert compute + comm + wait == pytest.approx(total, rel=1e-6)


def test_read_ahead_is_a_flag_of_train_checked_on_construction():
    assert TrainJob().options.read_ahead == 1 and TrainJob.of(read_ahead=0).options.read_ahead == 0
    with pytest.raises(ConfigError, match="--read-ahead"):
        TrainJob.of(read_ahead=-1)
