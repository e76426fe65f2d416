"""Measured runs for the auto-tuner: a configuration's step time and per-rank peak memory on the
ranks of a live job, and the one-process reference. Every function here is collective (each
rank calls it) and returns the same result on every rank; ``*_on_engine`` variants start
from ``dl.init()`` so a notebook can call them on an ipyparallel cluster.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..comm.protocol import Comm
from ..config import ParallelConfig
from .measure import JobCalibration


@dataclass(frozen=True)
class ModelSpec:
    """How every rank builds the model (``models.build_model`` arguments): a layer list is
    never shipped, each rank builds its own, seeded identically."""

    name: str = "resnet"
    num_layers: int | None = None
    num_filters: int | None = None
    num_classes: int = 2
    in_channels: int = 3
    dtype: str = "float32"
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype {self.dtype!r}: use float32 or float64")
        return dtype

    def build(self) -> list[nn.Module]:
        from ..models import build_model

        torch.manual_seed(self.seed)
        layers = build_model(self.name, num_layers=self.num_layers, num_filters=self.num_filters,
                             num_classes=self.num_classes, in_channels=self.in_channels)
        return [layer.to(self.torch_dtype) for layer in layers]

    def batch(self, image_size: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed + 1)
        images = torch.randn(batch_size, self.in_channels, image_size, image_size, generator=generator,
                             dtype=self.torch_dtype)
        labels = torch.randint(0, self.num_classes, (batch_size,), generator=generator)
        return images, labels


@dataclass(frozen=True)
class Measured:
    """A configuration as run: median step seconds (slowest rank) and each rank's peak bytes."""

    seconds: float
    step_seconds: tuple[float, ...]
    peaks: tuple[int, ...]

    @property
    def peak(self) -> int:
        return max(self.peaks)


def fastest_of_rounds(measurements: Sequence[Callable[[], Measured]], rounds: int = 1,
                      done: Callable[[int, Measured], None] | None = None) -> list[Measured]:
    """Run every measurement once per round, round-robin, for ``rounds`` rounds; keep each one's
    fastest: a shared machine's slow spells only ever add time, and interleaving spreads them over
    the configurations instead of landing on one. ``done(index, best so far)`` after each run."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: measure each configuration at least once")
    best: list[Measured | None] = [None] * len(measurements)
    for _ in range(rounds):
        for index, measure in enumerate(measurements):
            found = measure()
            current = best[index]
            if current is None or found.seconds < current.seconds:
                best[index] = current = found
            if done is not None:
                done(index, current)
    return [m for m in best if m is not None]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def measure_config(ctx: Comm, spec: ModelSpec, knobs: dict[str, Any], image_size: int, batch_size: int,
                   steps: int = 2) -> Measured:
    """Run ``ParallelConfig(**knobs)`` on every rank of ``ctx``: one warm-up step and one
    measured step under the allocation profiler (peak memory), then ``steps`` timed steps."""
    from ..pipeline.engine import HybridEngine
    from .measure import measure_engine_step, time_engine_steps

    cfg = ParallelConfig(**knobs)
    engine = HybridEngine(spec.build(), cfg, ctx, loss_fn=nn.CrossEntropyLoss(), optimizer=_sgd)
    images, labels = spec.batch(image_size, batch_size)
    peak = measure_engine_step(engine, images, labels, warmup=1)
    seconds = time_engine_steps(engine, images, labels, steps=steps, warmup=0)
    gathered = ctx.all_gather_object((peak, seconds))
    per_step = tuple(max(times) for times in zip(*(s for _, s in gathered)))
    return Measured(statistics.median(per_step), per_step, tuple(p for p, _ in gathered))


def measure_one_process(ctx: Comm, spec: ModelSpec, image_size: int, batch_size: int,
                        steps: int = 2, threads: int | None = None) -> Measured:
    """The same training on one process (rank 0, ``threads`` torch threads - default every
    core, as ``dl.init`` gives a job of one rank - the others wait): the reference every
    parallel configuration is compared with."""
    from .measure import measure_step_memory

    result = None
    if ctx.rank == 0:
        before = torch.get_num_threads()
        torch.set_num_threads(threads or os.cpu_count() or 1)
        try:
            model = nn.Sequential(*spec.build())
            optimizer = _sgd(model.parameters())
            images, labels = spec.batch(image_size, batch_size)
            loss_fn = nn.CrossEntropyLoss()

            def step() -> None:
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model(images), labels).backward()
                optimizer.step()

            peak = measure_step_memory(step, [model], optimizer, warmup=step)
            seconds = []
            for _ in range(steps):
                start = time.perf_counter()
                step()
                seconds.append(time.perf_counter() - start)
            result = Measured(statistics.median(seconds), tuple(seconds), (peak,))
        finally:
            torch.set_num_threads(before)
    ctx.barrier()   # the other ranks wait in the plane's wait mode, not polling a core rank 0 measures on
    measured = ctx.bcast_object(result, root=0)
    assert isinstance(measured, Measured)
    return measured


def measure_config_on_engine(spec: ModelSpec, knobs: dict[str, Any], image_size: int, batch_size: int,
                             steps: int = 2) -> Measured:
    """``measure_config`` on this process's ``dl.init()`` context (for ``cluster.run``)."""
    from ..comm.context import init

    return measure_config(init(), spec, knobs, image_size, batch_size, steps)


def measure_one_process_on_engine(spec: ModelSpec, image_size: int, batch_size: int,
                                  steps: int = 2) -> Measured:
    """``measure_one_process`` on this process's ``dl.init()`` context (for ``cluster.run``)."""
    from ..comm.context import init

    return measure_one_process(init(), spec, image_size, batch_size, steps)


def calibrate_job_on_engine() -> JobCalibration:
    """``measure.calibrate_job`` on this job (ping-pong, meeting cost, threads), for ``cluster.run``."""
    from ..comm.context import init
    from .measure import calibrate_job

    return calibrate_job(init())
