"""Measured runs for the auto-tuner: configurations' step times and per-rank peak memory on the
ranks of a live job, and the one-process reference, built side by side and their steps
interleaved so the machine's slow spells fall on all of them alike. Every function here is
collective (each rank calls it) and returns the same result on every rank; ``*_on_engine``
variants start from ``dl.init()`` so a notebook can call them on an ipyparallel cluster.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from ..comm.protocol import Comm
from ..comm.trace import Event
from ..comm.waiting import barrier_asleep
from ..config import ParallelConfig
from ..models import spec as model_spec
from ..models.model_args import NO_ARGS, ModelArgs
from ..models.spec import ModelFamily
from ..pipeline.actions import ActionKind
from .calibration import JobCalibration

Knobs = dict[str, Any]       # ``ParallelConfig(**knobs)``: a configuration as ``ParallelConfig.as_dict`` gives it
Result = TypeVar("Result")


@dataclass(frozen=True)
class TrialModel:
    """How every rank builds a trial's model: its spec, dtype and seed (a layer list is never shipped,
    each rank builds its own, seeded identically)."""

    model: model_spec.ModelSpec
    dtype: str = "float32"
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype {self.dtype!r}: use float32 or float64")
        return dtype

    def build(self) -> list[nn.Module]:
        torch.manual_seed(self.seed)
        return [layer.to(self.torch_dtype) for layer in self.model.build()]

    def batch(self, image_size: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed + 1)
        images = torch.randn(batch_size, self.model.in_channels, image_size, image_size, generator=generator,
                             dtype=self.torch_dtype)
        labels = torch.randint(0, self.model.num_classes, (batch_size,), generator=generator)
        return images, labels


def trial_model(name: ModelFamily | str = ModelFamily.RESNET, num_layers: int | None = None,
                num_filters: int | None = None, num_classes: int = 2, in_channels: int = 3,
                dtype: str = "float32", seed: int = 0, model_args: ModelArgs = NO_ARGS,
                image_size: int | None = None) -> TrialModel:
    """A trial of model ``name`` (``build_model``'s arguments; family defaults for sizes not given; a named
    model's constructor ``model_args``, and the image side it is built for, as ``train`` builds it: a timm Swin or
    ViT at ``image_size``, not its card's)."""
    spec = model_spec.ModelSpec.of(name, num_layers=num_layers, num_filters=num_filters, num_classes=num_classes,
                                   in_channels=in_channels, model_args=model_args, image_size=image_size)
    return TrialModel(spec, dtype, seed)


# the name notebook 05 and earlier scripts build a trial by: ModelSpec("resnet", num_layers=11, ...)
ModelSpec = trial_model


@dataclass(frozen=True)
class Measured:
    """A configuration as run: median step seconds (slowest rank), each rank's peak bytes, and
    each rank's traced seconds per step by action kind (``phases``; empty for one process)."""

    seconds: float
    step_seconds: tuple[float, ...]
    peaks: tuple[int, ...]
    phases: tuple[dict[str, float], ...] = ()

    @property
    def peak(self) -> int:
        return max(self.peaks)


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


@dataclass
class Trial:
    """One row of an auto-tune built on this rank: its training step (collective), this rank's
    measured peak bytes (None: the rank takes no part, e.g. off rank 0 for one process), and this
    rank's traced phases of each timed step (``time_trials``)."""

    step: Callable[[], object]
    peak: int | None
    phases: list[dict[str, float]] = field(default_factory=list)

    @property
    def idle(self) -> bool:
        """Whether this rank takes no part in the row (its step does nothing)."""
        return self.peak is None


def engine_trial(ctx: Comm, spec: TrialModel, knobs: Knobs, image_size: int, batch_size: int) -> Trial:
    """``ParallelConfig(**knobs)`` built on every rank of ``ctx``: one warm-up step and one step
    under the allocation profiler (its peak); then ready to step."""
    from ..pipeline.engine import HybridEngine
    from .steps import measure_engine_step

    engine = HybridEngine(spec.build(), ParallelConfig(**knobs), ctx, loss_fn=nn.CrossEntropyLoss(),
                          optimizer=_sgd, image_size=image_size)
    images, labels = spec.batch(image_size, batch_size)
    peak = measure_engine_step(engine, images, labels, warmup=1)
    return Trial(lambda: engine.train_step(images, labels), peak)


def one_process_trial(ctx: Comm, spec: TrialModel, image_size: int, batch_size: int) -> Trial:
    """The same training on rank 0 alone with a torch thread per core (as ``dl.init`` gives a
    job of one rank): the reference every configuration is compared with. The other ranks'
    step does nothing (they wait at the next barrier, asleep)."""
    from ..comm.waiting import node_cores
    from .steps import measure_step_memory

    if ctx.rank != 0:
        return Trial(lambda: None, None)
    model = nn.Sequential(*spec.build())
    optimizer = _sgd(model.parameters())
    images, labels = spec.batch(image_size, batch_size)
    loss_fn = nn.CrossEntropyLoss()
    cores = node_cores()

    def step() -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(cores)
        try:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(images), labels).backward()
            optimizer.step()
        finally:
            torch.set_num_threads(before)

    return Trial(step, measure_step_memory(step, [model], optimizer, warmup=step))


Row = Knobs | None     # a configuration's knobs; None: one process
HELD_TRIALS: list[Trial] = []    # this process's trials between ``build_trials`` and ``release_trials``
ACTION_OPS = frozenset(kind.value for kind in ActionKind)   # the runtime's one span per schedule action
WARM_STEPS = 1   # untimed steps of a row right before each of its timed ones (its caches warm, as in training)


def build_trials(ctx: Comm, spec: TrialModel, rows: Sequence[Row], image_size: int,
                 batch_size: int) -> list[tuple[int, ...]]:
    """Build every row in turn on the ranks (``engine_trial``; None: ``one_process_trial``) and
    hold them all, so ``time_trials`` can interleave their steps; the measured peaks of
    each row, every rank's (one process: rank 0's). Each row's peak is measured while only its own
    step runs; the rows held together keep their parameters and optimizer state meanwhile."""
    release_trials()
    for row in rows:
        trial = one_process_trial(ctx, spec, image_size, batch_size) if row is None else \
            engine_trial(ctx, spec, row, image_size, batch_size)
        HELD_TRIALS.append(trial)
        barrier_asleep(ctx, trial.idle)   # rank 0 alone measures one process's step: leave it the cores
    everyone = ctx.all_gather_object([trial.peak for trial in HELD_TRIALS])
    return [tuple(peak for peaks in everyone if (peak := peaks[index]) is not None) for index in range(len(rows))]


def pass_order(rows: int, index: int) -> list[int]:
    """The order of the rows in interleaved pass ``index``: row ``index`` of a Williams design (a
    Latin square balanced for carry-over; its n orders, 2n for odd n, are taken in turn), so over
    a cycle every row comes right after every other row equally often, and every rank steps the
    same row at the same time. In one fixed order the step after the one-process reference, which
    ran 2.7% slower (11 of 12 jobs), was always suggest's first choice."""
    first, low, high = [0], 1, rows - 1
    while len(first) < rows:
        if len(first) % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    orders = [[(row + shift) % rows for row in first] for shift in range(rows)]
    if rows % 2:
        orders += [order[::-1] for order in orders]
    return orders[index % len(orders)]


def time_trials(ctx: Comm, steps: int, first_pass: int = 0) -> list[tuple[float, ...]]:
    """``steps`` timed passes over the held rows: one timed step of each row per pass, in the pass's own
    order (``pass_order(rows, first_pass + k)``), each step started together at a barrier, so a
    slow spell of the machine (seconds long on shared cores: the same configuration measured 0.14
    and 0.20 s a step in two jobs a minute apart) falls on every row alike. Right before each timed step the row
    takes ``WARM_STEPS`` untimed ones: its memory back in cache after another row's step, as in a training run
    (timed cold, a small ViT's and Swin's rows on 2 ranks took 15-25% longer than their own steps in a row). A rank
    that took no part in the step before a barrier (the one-process row off rank 0) waits in it asleep
    (``barrier_asleep``). Per row: each timed step's seconds on the slowest rank."""
    if not HELD_TRIALS:
        raise RuntimeError("no trials held: call build_trials first")
    seconds: list[list[float]] = [[] for _ in HELD_TRIALS]
    tracer = ctx.tracer
    idle = False     # whether this rank took no part in the step just run (it then waits asleep)
    for k in range(steps):
        for index in pass_order(len(HELD_TRIALS), first_pass + k):
            trial = HELD_TRIALS[index]
            for _ in range(WARM_STEPS):    # the row's own memory back in cache after another row's step
                barrier_asleep(ctx, idle)
                trial.step()
                idle = trial.idle
            barrier_asleep(ctx, idle)
            position = tracer.recorded
            start = time.perf_counter()
            trial.step()
            seconds[index].append(time.perf_counter() - start)
            trial.phases.append(_phases(tracer.since(position)))
            idle = trial.idle
    barrier_asleep(ctx, idle)
    everyone = ctx.all_gather_object(seconds)
    return [tuple(max(times) for times in zip(*(rank[index] for rank in everyone)))
            for index in range(len(HELD_TRIALS))]


def _phases(events: Sequence[Event]) -> dict[str, float]:
    """Seconds per action kind among ``events`` (the runtime's action spans; halo exchanges and
    other spans inside them are part of their action's time)."""
    found: dict[str, float] = {}
    for event in events:
        if event.op in ACTION_OPS:
            found[event.op] = found.get(event.op, 0.0) + event.duration
    return found


def trial_phases(ctx: Comm, skip: int = 0) -> list[tuple[dict[str, float], ...]]:
    """Per held row, every rank's mean traced seconds per step by action kind over its timed
    steps but the first ``skip`` (``measure_interleaved``: the warm pass). Collective."""
    mine = []
    for trial in HELD_TRIALS:
        kept = trial.phases[skip:]
        total: dict[str, float] = {}
        for sample in kept:
            for op, seconds in sample.items():
                total[op] = total.get(op, 0.0) + seconds / len(kept)
        mine.append(total)
    everyone = ctx.all_gather_object(mine)
    return [tuple(rank[index] for rank in everyone) for index in range(len(mine))]


def release_trials() -> None:
    """Drop the held rows (their engines, memory and traced phases)."""
    HELD_TRIALS.clear()


def measured(peaks: tuple[int, ...], step_seconds: Sequence[float],
             phases: tuple[dict[str, float], ...] = ()) -> Measured:
    """A row's Measured: the median of its steps (slowest rank), its peaks, its ranks' phases."""
    return Measured(statistics.median(step_seconds), tuple(step_seconds), peaks, phases)


def _engine_context() -> Comm:
    from ..comm.context import init

    return init()


def build_trials_on_engine(spec: TrialModel, rows: Sequence[Row], image_size: int,
                           batch_size: int) -> list[tuple[int, ...]]:
    """``build_trials`` on this process's ``dl.init()`` context."""
    return build_trials(_engine_context(), spec, rows, image_size, batch_size)


def time_trials_on_engine(steps: int, first_pass: int = 0) -> list[tuple[float, ...]]:
    """``time_trials`` on this process's ``dl.init()`` context."""
    return time_trials(_engine_context(), steps, first_pass)


def trial_phases_on_engine(skip: int = 0) -> list[tuple[dict[str, float], ...]]:
    """``trial_phases`` on this process's ``dl.init()`` context."""
    return trial_phases(_engine_context(), skip)


def release_trials_on_engine() -> None:
    """``release_trials`` on this process."""
    release_trials()


class Runner(Protocol):
    """``run(function, *args)``: ``function`` on every rank, one rank's result (``here``, or ``cluster.run``'s)."""

    def __call__(self, function: Callable[..., Result], /, *args: object) -> Result: ...


def here(function: Callable[..., Result], /, *args: object) -> Result:
    """The Runner of a rank that is itself one of the ranks (``mpiexec``): call ``function``."""
    return function(*args)


def measure_interleaved(run: Runner, spec: TrialModel, rows: Sequence[Row], image_size: int, batch_size: int,
                        steps: int = 2, rounds: int = 1,
                        done: Callable[[list[Measured]], None] | None = None) -> list[Measured]:
    """Every row built side by side on the ranks (``build_trials``), one untimed interleaved
    step each (all warm again after the others were built), then ``rounds`` rounds of ``steps``
    interleaved timed steps (``time_trials``), then released. Each row's time: the median of its
    steps so far, with each rank's mean traced phases of them (``trial_phases``);
    ``done(measured rows)`` after each round. ``run``: ``here`` on ranks started by mpiexec,
    ``cluster.run`` (rank 0's result) from a notebook."""
    if steps < 1 or rounds < 1:
        raise ValueError(f"steps={steps}, rounds={rounds}: time each configuration at least once")
    try:
        peaks = run(build_trials_on_engine, spec, list(rows), image_size, batch_size)
        run(time_trials_on_engine, 1)
        seconds: list[list[float]] = [[] for _ in rows]
        results: list[Measured] = []
        for round_index in range(rounds):
            for mine, found in zip(seconds, run(time_trials_on_engine, steps, 1 + round_index * steps)):
                mine.extend(found)
            phases = run(trial_phases_on_engine, 1) or [() for _ in rows]   # the warm pass left out
            results = [measured(p, s, ph) for p, s, ph in zip(peaks, seconds, phases)]
            if done is not None:
                done(results)
        return results
    finally:
        run(release_trials_on_engine)


def measure_config_on_engine(spec: TrialModel, knobs: Knobs, image_size: int, batch_size: int,
                             steps: int = 2) -> Measured:
    """``ParallelConfig(**knobs)`` alone on this process's ``dl.init()`` job (for ``cluster.run``)."""
    return measure_interleaved(here, spec, [knobs], image_size, batch_size, steps)[0]


def calibrate_job_on_engine() -> JobCalibration:
    """``measure.calibration.calibrate_job`` on this job (ping-pong, meeting cost, threads), for ``cluster.run``."""
    from .calibration import calibrate_job

    return calibrate_job(_engine_context())


def device_on_engine() -> str:
    """This job's device (``ctx.device``: where the planner measures for it), for ``cluster.run``."""
    return str(_engine_context().device)
