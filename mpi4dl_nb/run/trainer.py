"""The training loop of batch jobs: region-aware inputs, steps with metrics, progress on rank 0, checkpoint/resume,
pre-emption (a stop signal: the step finished, a checkpoint, the run ends)."""
from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import torch
from torch import nn

from ..checkpoint.files import BestMark, new_run_id
from ..checkpoint.optimizer_state import gather_optimizer_state, load_optimizer_state
from ..checkpoint.record import LoadedCheckpoint, OptimizerState, RunRecord, write_checkpoint
from ..comm.determinism import Determinism, deterministic_run
from ..config import ParallelConfig
from ..data import Batcher, RegionDataset
from ..data.dataset import input_size
from ..data.read_ahead import ReadAhead
from ..data.task import Task
from ..evaluation.batch_inputs import BatchInputs
from ..evaluation.metrics import MetricName
from ..measure.usage import ActivationMeter, RunMetrics, cuda_peak_bytes, state_bytes
from ..pipeline.actions import ActionKind
from ..pipeline.layer_decay import gathered_groups, group_rates, rate_records
from ..pipeline.optim import LRSchedule
from .batch_reads import BatchRead, BatchReads, Position, StepBatch
from .divergence import NonFiniteError, NonFiniteGuard, first_nonfinite
from .monitor import JobMonitor, StepTimer
from .preemption import Preempted, StopSignals
from .summary import RankMetrics, TrainSummary, Validation, finite_or_none
from .train_progress import TrainProgress

if TYPE_CHECKING:
    from ..comm.protocol import Comm
    from ..evaluation.evaluator import Evaluator
    from ..evaluation.log import MetricsLog
    from ..evaluation.pixel_evaluator import SegmentationEvaluator
    from ..models.spec import ModelSpec
    from ..pipeline.engine import HybridEngine


@dataclass(frozen=True)
class TrainSettings:
    """How long to train and when to checkpoint."""

    steps: int                          # total optimizer steps of the run (resumed or not)
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0           # 0: at the end of every epoch and of the run
    keep_checkpoints: int = 2
    progress: bool = True
    verbose: bool = False
    dtype: torch.dtype = torch.float32
    keep_trace: bool = False            # True: keep every trace event (unbounded), not a window
    step_timeout: float | None = None   # seconds without progress that abort the job; None/0: off
    auto_step_timeout: bool = False     # derive the timeout from the first steps (batch jobs)
    eval_every: int = 0                 # with an evaluator: every N steps (0: epoch ends only) and at the end
    lr_schedule: LRSchedule | None = None   # the learning rate of every step (None: the optimizer's, constant)
    keep_best: MetricName | None = None     # with an evaluator and checkpoint_dir: keep the best checkpoint apart
    early_stop: int | None = None           # with keep_best: stop after N evaluations in a row without a better one
    task: Task = Task.CLASSIFICATION        # segmentation: the labels are masks, read by box where the loss runs
    accumulate: int = 1                     # batches (micro-steps) per optimizer step: gradient accumulation
    read_ahead: int = 1                     # steps whose input a worker thread reads before they start (0: inline)
    determinism: Determinism = Determinism.AUTO   # torch's deterministic algorithms during run() (auto: float64)


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (every rank raises it; the older checkpoints are intact)."""


EXIT_CHECKPOINT = 5


# --------------------------------------------------------------------- pre-flight
def check_layout(cfg: ParallelConfig, layers: Sequence[nn.Module], batch_size: int,
                 image_size: int | tuple[int, int, int]) -> None:
    """ConfigError unless ``cfg`` fits this model, batch and image: stage count, batch split, spatial halos (a
    volume's ``(D, H, W)``: its tiles against the grid; the engine plans the 3-D halos)."""
    cfg.validate(batch_size=batch_size, num_layers=len(layers), image_size=image_size)
    if isinstance(image_size, int):
        check_spatial_geometry(layers, cfg, image_size)


def check_spatial_geometry(layers: Sequence[nn.Module], cfg: ParallelConfig, image_size: int,
                           channels: int | None = None) -> None:
    """Refuse, before any rank starts, a spatial split whose halos would not fit the tiles.

    Runs the spatial stages on shape-only ``meta`` tensors and plans every conv/pool's halo
    on the tile grid, which raises ``ConfigError`` (naming the layer) when a tile is thinner
    than the layer's reach. The stage cut is the engine's at this image size
    (``pipeline.default_cut.check_fit``: ``balance``, or the default cut that fits the tiles);
    ``channels``: the images' (None: what the first conv takes).
    """
    from ..pipeline.default_cut import check_fit

    check_fit(list(layers), cfg, image_size, in_channels=channels)


# ---------------------------------------------------------------------- trainer
class Trainer:
    """Runs ``settings.steps`` optimizer steps of ``engine`` on ``batcher``'s data; all ranks call it.

    ``record`` (what the run is: model, data, layout, seed, identity) goes into every checkpoint
    and starts the summary; a Trainer that writes checkpoints needs one.
    """

    def __init__(self, engine: HybridEngine, batcher: Batcher, ctx: Comm, settings: TrainSettings,
                 record: RunRecord | None = None, *, run_id: str | None = None, monitor: JobMonitor | None = None,
                 guard: NonFiniteGuard | None = None, evaluator: Evaluator | SegmentationEvaluator | None = None,
                 log: MetricsLog | None = None) -> None:
        if settings.checkpoint_dir is not None and record is None:
            raise ValueError("a Trainer that writes checkpoints needs the run's record (RunRecord: model spec, "
                             "data, seed), so that evaluate, infer and resume can read them")
        if settings.keep_best is not None and (settings.checkpoint_dir is None or evaluator is None):
            raise ValueError("keep_best needs a checkpoint_dir to keep the best checkpoint in and an evaluator "
                             "to measure it")
        self.engine = engine
        self.evaluator = evaluator
        self.log = log                     # rank 0's metrics log (None: none, or another rank)
        self.validation: Validation | None = None   # the latest evaluation
        self.batcher = batcher
        self.ctx = ctx
        self.settings = settings
        self.record = record
        self.run_id = run_id or new_run_id()
        self.guard = guard
        self.timer = StepTimer(given=None if settings.auto_step_timeout else (settings.step_timeout or 0))
        self._own_monitor = monitor is None and self.timer.timeout() is not None
        self.monitor = JobMonitor.start(ctx) if self._own_monitor else monitor
        if self.monitor is not None:
            self.monitor.follow(self.current_action)
        dataset = batcher.dataset
        self.inputs = BatchInputs(engine, ctx.rank, input_size(dataset), batcher.batch_size, settings.dtype,
                                  settings.task.dense)
        self.reads = BatchReads(batcher, self.inputs, settings.task.dense)
        self.read_ahead: ReadAhead[int, list[BatchRead]] | None = None   # while run() runs with settings.read_ahead
        self.metrics = RunMetrics()
        self.step = 0
        self.skipped_steps: list[int] = []
        self.last_checkpoint: Path | None = None
        self.preempted: Preempted | None = None     # a stop signal ended the run (every rank; its path on rank 0)
        self.best: BestMark | None = None           # the best evaluation so far (settings.keep_best)
        self.best_checkpoint: Path | None = None
        self.stale = 0                              # evaluations since the best one (settings.early_stop)
        self.early_stopped: int | None = None       # the step settings.early_stop ended the run at
        self.lr_groups = gathered_groups(engine.optimizer, ctx)   # every optimizer group's (name, scale): rank 0's
        params = [p for inst in engine.instances.values() for p in inst.canonical.parameters()]
        self.meter = ActivationMeter(exclude=params)
        if settings.keep_trace:
            ctx.tracer.configure(window_steps=None, max_events=None)
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)

    @classmethod
    def for_data(cls, engine: HybridEngine, data: RegionDataset, ctx: Comm, settings: TrainSettings, *,
                 batch_size: int, model: ModelSpec | nn.Module | Sequence[nn.Module] | str, seed: int = 0,
                 val_fraction: float | None = None, validation: RegionDataset | None = None,
                 log_dir: str | Path | None = None) -> Trainer:
        """A Trainer of ``engine`` on ``data``, set up from Python as ``train`` sets one up from its flags (every
        rank calls it alike, after building the same engine).

        Batches of ``batch_size`` images in an order seeded by ``seed``; ``val_fraction`` of each class held out
        (seeded, stratified: ``train --val-fraction``) or ``validation`` (other images) evaluated at each epoch
        end, every ``settings.eval_every`` steps and at the end; ``metrics.jsonl`` in ``log_dir`` (rank 0).
        Checkpoints (``settings.checkpoint_dir``) record ``model``: a ``ModelSpec`` (``evaluate`` and ``infer``
        rebuild it), or the model object (an nn.Module or its layer list) or a name for it, recorded as
        ``python:<name>``: their readers then take the model object as ``model=...`` (``dl.model_state_dict``,
        ``dl.evaluate``, ``dl.infer_slide``).
        """
        from ..evaluation.log import MetricsLog
        from .held_out import evaluator_for, shared_run_id
        from .python_run import record_for, split_dataset

        if val_fraction is not None and validation is not None:
            raise ValueError("give val_fraction (held out of data) or validation (other images), not both")
        train, held = split_dataset(data, val_fraction, seed) if val_fraction is not None else (data, validation)
        record = record_for(model, data, batch_size, seed=seed, dtype=settings.dtype, val_fraction=val_fraction,
                            validation=validation)
        evaluator = None if held is None else evaluator_for(engine, held, ctx, batch_size, record, settings.dtype)
        run_id = shared_run_id(ctx)
        trainer = cls(engine, Batcher(train, batch_size, seed=seed), ctx, settings, record, run_id=run_id,
                      evaluator=evaluator)
        if log_dir is not None and ctx.rank == 0:
            trainer.log = MetricsLog(log_dir, trainer.run_id)
        return trainer

    @property
    def validation_data(self) -> RegionDataset | None:
        """The held-out images the evaluator measures (None: no evaluation)."""
        dataset = getattr(self.evaluator, "dataset", None)
        return dataset if isinstance(dataset, RegionDataset) else None

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch: the batches of an epoch over ``settings.accumulate`` (at least 1)."""
        return max(1, self.batcher.steps_per_epoch // self.settings.accumulate)

    @property
    def images_per_step(self) -> int:
        """Images one optimizer step trains on (``accumulate`` batches)."""
        return self.batcher.batch_size * self.settings.accumulate

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch in epoch) of the first batch of optimizer step ``step``."""
        return divmod(step * self.settings.accumulate, self.batcher.steps_per_epoch)

    # ------------------------------------------------------------ checkpointing
    def checkpoint_due(self, step: int) -> bool:
        if self.settings.checkpoint_dir is None:
            return False
        if step == self.settings.steps:
            return True
        every = self.settings.checkpoint_every
        return step % every == 0 if every > 0 else step % self.steps_per_epoch == 0

    def save(self, best: bool = False) -> Path | None:
        """Write the checkpoint of the current step (collective; rank 0 writes atomically); ``best``: as the
        run's best checkpoint (outside the rotation, replacing the previous best).

        A non-finite state is never written; a failed write leaves the older checkpoints as
        they were. Either way every rank raises the same error (NonFiniteError or
        CheckpointWriteError), so the job stops together.
        """
        model = self.engine.full_state_dict()
        optimizer = gather_optimizer_state(self.engine, self.ctx)
        path, error, kind = None, None, None
        if self.ctx.rank == 0:
            bad = first_nonfinite([("model", model or {}), ("optimizer", optimizer or {})])
            if bad is not None:
                error, kind = f"step {self.step}: {bad} is not finite; this state is not saved.", "nonfinite"
            else:
                error, path = self._write(model or {}, optimizer, best)
                kind = "write" if error else None
        error, kind = self.ctx.bcast_object((error, kind), root=0)
        if error is not None:
            raise (NonFiniteError(self.step, error) if kind == "nonfinite" else CheckpointWriteError(error))
        if best:
            self.best_checkpoint = path
        else:
            self.last_checkpoint = path
        return path

    def _write(self, model: dict[str, torch.Tensor], optimizer: OptimizerState | None,
               best: bool = False) -> tuple[str | None, Path | None]:
        """Rank 0: write the checkpoint; (error text, None) when the file system refuses it."""
        assert self.settings.checkpoint_dir is not None and self.record is not None
        record = replace(self.record, config=self.engine.cfg.as_dict(), best=self.best,
                         param_groups=rate_records(self.lr_groups, self.lr)).at(self.step, self.run_id)
        phase = self.monitor.phase("writing a checkpoint", exempt=True) if self.monitor else nullcontext()
        try:
            with phase:
                path = write_checkpoint(self.settings.checkpoint_dir, record, model, optimizer,
                                        keep=self.settings.keep_checkpoints, best=best)
        except OSError as err:
            return (f"could not write the checkpoint of step {self.step} to "
                    f"{self.settings.checkpoint_dir}: {err}; the older checkpoints are intact "
                    f"(last: {self.last_checkpoint}); free space or fix the directory, then "
                    f"rerun with --resume latest"), None
        if self.settings.verbose:
            print(f"checkpoint of step {self.step}: {path}", file=sys.stderr, flush=True)
        return None, path

    def restore(self, checkpoint: LoadedCheckpoint | None) -> int:
        """Load a checkpoint given on rank 0 (None elsewhere) into every rank; returns its step."""
        root = checkpoint if self.ctx.rank == 0 else None
        self.engine.load_full_state_dict(root.model_state if root is not None else None)
        load_optimizer_state(self.engine, self.ctx, root.optimizer_state if root is not None else None)
        self.step = int(self.ctx.bcast_object(root.record.step if root is not None else None, root=0) or 0)
        mark = self.ctx.bcast_object(root.record.best if root is not None else None, root=0)
        metric = self.settings.keep_best
        self.best = mark if metric is not None and mark is not None and mark.metric == metric.value else None
        return self.step

    # --------------------------------------------------------------- evaluation
    def evaluation_due(self, step: int) -> bool:
        if self.evaluator is None:
            return False
        every = self.settings.eval_every
        return step == self.settings.steps or step % self.steps_per_epoch == 0 or (every > 0 and step % every == 0)

    def evaluate(self) -> Validation:
        """Evaluate the current weights on the validation set (collective); records and returns the figures and,
        when they are the best so far by ``settings.keep_best``, writes the best checkpoint."""
        assert self.evaluator is not None
        phase = self.monitor.phase("evaluating", exempt=True) if self.monitor else nullcontext()
        start = time.perf_counter()
        with phase:
            metrics = self.evaluator.run()
        self.validation = Validation(self.step, metrics, time.perf_counter() - start, self.evaluator.loss.describe())
        kept = self.improved(self.validation)
        self.stale = 0 if kept else self.stale + 1
        if self.log is not None:
            best = {"best": self.best.to_dict()} if kept and self.best is not None else {}
            self.log.write("eval", self.step, {"epoch": self.position(self.step - 1)[0],
                                               **self.validation.as_dict(), **best})
        if kept:
            self.save(best=True)
        return self.validation

    def improved(self, validation: Validation) -> bool:
        """Whether ``validation`` beats the best so far by ``settings.keep_best`` (then it is the best)."""
        metric = self.settings.keep_best
        value = metric.of(validation.metrics) if metric is not None else None
        if metric is None or value is None or not metric.better(value, self.best.value if self.best else None):
            return False
        self.best = BestMark(metric.value, value, validation.step)
        return True

    # ----------------------------------------------------------------- training
    def current_action(self) -> str | None:
        """The action this rank is in (None: no step under way): what the monitor reads at each heartbeat, so a
        step costs it no call per action."""
        action = self.engine.next_action()
        if action is None:
            return None
        checked = self.guard is not None and action.kind is ActionKind.OPTIM
        return action.describe() + (" (first: the all-gather of the non-finite check)" if checked else "")

    def batch(self, epoch: int, step: int) -> StepBatch:
        """This rank's images and labels of batch ``step`` of ``epoch`` (``BatchInputs``: masks read by box), read
        when the engine asks for them."""
        return self.reads.batch((epoch, step))

    def positions(self, step: int) -> list[Position]:
        """(epoch, batch in epoch) of each batch of optimizer step ``step`` (``accumulate`` of them)."""
        first = step * self.settings.accumulate
        return [divmod(first + k, self.batcher.steps_per_epoch) for k in range(self.settings.accumulate)]

    def read_step(self, step: int) -> list[BatchRead]:
        """Every read of step ``step``'s batches the engine makes of this rank (what the read-ahead worker runs)."""
        return [self.reads.ahead(position) for position in self.positions(step)]

    def step_batches(self) -> list[StepBatch]:
        """The current step's batches: read ahead (waited for, as ``waiting for input`` to the monitor), else read
        when the engine asks for them."""
        ready: list[BatchRead | None] = [None] * self.settings.accumulate
        if self.read_ahead is not None:
            phase = self.monitor.phase("waiting for input") if self.monitor else nullcontext()
            with phase:
                taken = self.reads.timed(self.read_ahead.take)
            if taken is not None and taken[0] == self.step:
                ready = list(taken[1])
        return [self.reads.batch(position, read) for position, read in zip(self.positions(self.step), ready)]

    def train_one(self) -> float:
        """One optimizer step at the current position (``accumulate`` batches); returns the global loss (their
        mean; NaN when skipped)."""
        if self.monitor is not None:
            self.monitor.begin_step(self.step + 1)
        if self.guard is not None:
            self.guard.begin_step(self.step + 1)
        if self.settings.lr_schedule is not None:
            self.settings.lr_schedule.apply(self.engine.optimizer, self.step)
        tracer = self.ctx.tracer
        device = self.ctx.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()           # the step's time includes its wait for input
        batches = self.step_batches()
        with self.meter:
            loss = self.engine.train_accumulated(batches, on_action=self.guard.on_action if self.guard else None,
                                                 batch_size=self.batcher.batch_size)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        traced = tracer.last_step()   # the engine's step, summarised by the (bounded) trace
        comm = traced.comm_seconds if traced is not None else 0.0
        self.step += 1
        if self.guard is not None and self.guard.end_step(loss):
            self.skipped_steps.append(self.step)
        self.metrics.add_step(self.images_per_step, seconds, comm, loss)
        self.timer.add(seconds)
        if self.monitor is not None:
            self.monitor.arm(self.timer.timeout())
        return loss

    def run(self, stream: TextIO | None = None) -> TrainSummary | None:
        """Train up to ``settings.steps`` or until a stop signal (``preempted``); returns the summary on rank 0 (None
        elsewhere)."""
        bar = TrainProgress(self.settings.steps, self.settings.progress and self.ctx.rank == 0, stream,
                            first_step=self.step)
        stop = StopSignals().install()
        wall = time.perf_counter()
        start_step = self.step
        if self.monitor is not None:
            self.monitor.arm(self.timer.timeout())
        with deterministic_run(self.settings.determinism, self.settings.dtype):
            try:
                self.start_read_ahead()
                while self.step < self.settings.steps:
                    loss = self.train_one()
                    recent = self.metrics.seconds / max(1, self.metrics.steps)
                    rate = self.images_per_step / max(recent, 1e-12)
                    if self.log is not None:
                        self.log.write("train", self.step, {"epoch": self.position(self.step - 1)[0],
                                                            "loss": loss, "images_per_s": rate,
                                                            "seconds": self.metrics.step_seconds[-1], "lr": self.lr,
                                                            **group_rates(self.lr_groups, self.lr)})
                    if self.evaluation_due(self.step):
                        validation = self.evaluate()
                        line = validation.line()
                        if self.best is not None and self.best.step == validation.step:
                            line += f" (the best {self.best.metric} so far: kept)"
                        if bar.enabled:
                            bar.note(line)
                        elif self.ctx.rank == 0:     # results, shown without the bar too
                            print(line, file=stream or sys.stderr, flush=True)
                    accuracy = self.validation.metrics.accuracy if self.validation is not None else None
                    bar.step(self.step, loss, rate, accuracy)
                    if self.checkpoint_due(self.step):
                        self.save()
                    if self.step < self.settings.steps and (self.stops_early(stream) or self.stopped(stop)):
                        break
                return self.summary(start_step, time.perf_counter() - wall)
            finally:
                self.stop_read_ahead()
                stop.restore()
                bar.finish()
                if self.log is not None:
                    self.log.close()
                if self.monitor is not None:
                    self.monitor.arm(None)
                    self.monitor.follow(None)
                    if self._own_monitor:
                        self.monitor.close()

    def stops_early(self, stream: TextIO | None = None) -> bool:
        """``settings.early_stop``: whether the latest evaluations (every rank has the same figures) have not beaten
        the best for that many in a row; then the step's checkpoint is written (unless it is already), the best one
        kept, and rank 0 says so."""
        patience = self.settings.early_stop
        if patience is None or self.stale < patience:
            return False
        if self.settings.checkpoint_dir is not None and not self.checkpoint_due(self.step):
            self.save()
        self.early_stopped = self.step
        if self.ctx.rank == 0 and self.best is not None:
            print(f"early stop at step {self.step}: {self.best.metric} has not improved for {self.stale} "
                  f"evaluations (--early-stop {patience}); the best, {self.best.value:.6g} at step {self.best.step}, "
                  f"is kept: {self.best_checkpoint or 'best-step-*.pt'}", file=stream or sys.stderr, flush=True)
        return True

    def start_read_ahead(self) -> None:
        """Start the worker reading the input of the steps from the current one on, ``settings.read_ahead`` ahead
        (none with 0, or with no step left)."""
        self.stop_read_ahead()
        if self.settings.read_ahead > 0 and self.step < self.settings.steps:
            self.read_ahead = ReadAhead(range(self.step, self.settings.steps), self.read_step, self.settings.read_ahead)

    def stop_read_ahead(self) -> None:
        """Stop the worker and join it (the end of the run, an error, an early stop)."""
        if self.read_ahead is not None:
            self.read_ahead.close()
            self.read_ahead = None

    def stopped(self, stop: StopSignals) -> bool:
        """Whether a rank got a stop signal (collective, after a step): then every rank saves this step (unless its
        checkpoint is written already, or there is no checkpoint directory) and ``preempted`` says so."""
        signal = stop.agreed_signal(self.ctx)
        if signal is None:
            return False
        if self.settings.checkpoint_dir is not None and not self.checkpoint_due(self.step):
            self.save()
        saved = self.last_checkpoint if self.settings.checkpoint_dir is not None else None
        self.preempted = Preempted(signal, self.step, saved)
        return True

    @property
    def lr(self) -> float | None:
        """The learning rate of the last step taken (None: no optimizer): the run's own, before a group's
        ``--layer-decay`` scale."""
        optimizer = self.engine.optimizer
        if optimizer is None or not optimizer.param_groups:
            return None
        group = optimizer.param_groups[0]
        return float(group["lr"]) / float(group.get("lr_scale", 1.0))

    def rank_metrics(self) -> RankMetrics:
        """This rank's metrics: time split and peak memory (allocator peak on CUDA, counted on CPU)."""
        buffers = {id(b): b for inst in self.engine.instances.values()
                   for b in inst.canonical.buffers()}
        # what the rank keeps between steps: weights (ZeRO's shards; stage 3 frees the whole ones), their gradients,
        # buffers and optimizer state, each storage once (sharding/; docs/sharding.md)
        fixed = state_bytes(self.engine.trained_tensors(), self.engine.optimizer, buffers.values())
        peak = cuda_peak_bytes(self.ctx.device)
        m = self.metrics
        wait = self.reads.wait_seconds
        return RankMetrics(rank=self.ctx.rank, steps=m.steps, seconds=m.seconds,
                           compute_seconds=max(0.0, m.compute_seconds - wait), input_wait_seconds=wait,
                           comm_seconds=m.comm_seconds, state_bytes=fixed, activation_peak_bytes=self.meter.peak,
                           peak_bytes=peak if peak is not None else fixed + self.meter.peak,
                           memory_source="cuda-allocator" if peak is not None else "counted")

    def summary(self, start_step: int, wall: float) -> TrainSummary | None:
        """The run's summary on rank 0 (collective)."""
        per_rank = self.ctx.gather_object(self.rank_metrics(), root=0)
        if per_rank is None:
            return None
        warm = 1 if self.metrics.steps >= 3 else 0
        measured = self.metrics.seconds_after(warm)
        images = (self.metrics.steps - warm) * self.images_per_step
        last = self.metrics.last_loss
        return TrainSummary(
            record=self.record, world_size=self.ctx.world_size, start_step=start_step, steps=self.step,
            steps_run=self.metrics.steps, untimed_steps=warm,
            images_per_s=images / measured if measured > 0 else None,
            loss=finite_or_none(last) if last is not None else None,
            losses=[finite_or_none(v) for v in self.metrics.losses], skipped_steps=list(self.skipped_steps),
            run_id=self.run_id, wall_seconds=wall, ranks=per_rank,
            checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None,
            validation=self.validation, config=self.engine.cfg.as_dict(), best=self.best,
            best_checkpoint=str(self.best_checkpoint) if self.best_checkpoint else None,
            preempted=self.preempted.signal.name if self.preempted is not None else None,
            early_stopped=self.early_stopped,
            deterministic=torch.are_deterministic_algorithms_enabled())
