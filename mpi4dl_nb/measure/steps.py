"""Measuring what the planner predicts: a step's peak memory on a rank, its wall time, the network.

Memory on CPU comes from the PyTorch profiler's allocation record (glibc keeping freed
memory makes RSS useless), on CUDA from the caching allocator's peak. The measured peak of
a step is the bytes the rank holds when the step starts (parameters, buffers, optimizer
state, anything its layers keep across steps) plus the most the step allocates on top.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from .usage import state_bytes

if TYPE_CHECKING:
    from torch.profiler import profile

    from ..pipeline.engine import HybridEngine
    from ..pipeline.step_input import Images, Labels

STEP_MARK = "mpi4dl_nb.measured_step"
# torch's profiler library prints two lines on stderr at every start and stop (35 lines in one
# ``tune`` run) unless its log level is above them; a level the user set is kept
KINETO_LOG_LEVEL, QUIET_PROFILER = "KINETO_LOG_LEVEL", "6"
# torch 2.11's profiler warns at every first start that it "clears events at the end of each cycle" (torch 2.14 only
# when a profiler starts again): one cycle here, nothing is lost
PROFILER_CYCLE_WARNING = "Warning: Profiler clears events at the end of each cycle"
Result = TypeVar("Result")


@dataclass(frozen=True)
class ProfiledEvent:
    """One event of the profiler's trace: its name, start and length (us), and for a ``[memory]`` event the
    address and bytes (negative: freed) on device type ``device`` (0: CPU)."""

    name: str
    start: float
    duration: float | None = None
    address: int = 0
    nbytes: int = 0
    device: int = 0


def _trace_events(prof: profile) -> list[ProfiledEvent]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as handle:
            raw = json.load(handle).get("traceEvents", [])
    events = []
    for event in raw:
        args = event.get("args") or {}
        duration = event.get("dur")
        events.append(ProfiledEvent(str(event.get("name", "")), float(event.get("ts", 0)),
                                    None if duration is None else float(duration), int(args.get("Addr", 0)),
                                    int(args.get("Bytes", 0)), int(args.get("Device Type", 0))))
    return events


def _allocated_peak(events: list[ProfiledEvent], window: tuple[float, float] | None) -> int:
    """Most CPU bytes alive at once among those allocated during the profile (inside
    ``window``, in us, if given).

    Computed from each allocation and free (address, bytes) rather than the profiler's
    running total, which carries allocations of earlier profiles that were never freed
    while one was running.
    """
    live: dict[int, int] = {}
    current = peak = 0
    memory = sorted((e for e in events if e.name == "[memory]" and e.device == 0), key=lambda e: e.start)
    for e in memory:
        if e.nbytes > 0:
            current += e.nbytes - live.get(e.address, 0)
            live[e.address] = e.nbytes
        elif e.address in live:
            current -= live.pop(e.address)
        if window is None or window[0] <= e.start <= window[1]:
            peak = max(peak, current)
    return peak


def _window(events: list[ProfiledEvent]) -> tuple[float, float] | None:
    for e in events:
        if e.name == STEP_MARK and e.duration is not None:
            return (e.start, e.start + e.duration)
    return None


def measure_peak_bytes(fn: Callable[[], Result], device: torch.device | str = "cpu",
                       before: Callable[[], object] | None = None) -> tuple[Result, int]:
    """Run ``before()`` (if given) then ``fn()``; return (``fn``'s result, the most bytes
    allocated during ``fn`` above what was allocated when the measurement began).

    Allocations of ``before`` (a warm-up step: optimizer state, staging buffers) that are
    still alive count too, so one measurement covers what the step keeps across steps.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        if before is not None:
            before()
            torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - start
    from torch.profiler import ProfilerActivity, profile, record_function

    os.environ.setdefault(KINETO_LOG_LEVEL, QUIET_PROFILER)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PROFILER_CYCLE_WARNING, category=UserWarning)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            if before is not None:
                before()
            with record_function(STEP_MARK):
                result = fn()
    events = _trace_events(prof)
    return result, _allocated_peak(events, _window(events))


def measure_step_memory(step: Callable[[], object], modules: Iterable[nn.Module],
                        optimizer: torch.optim.Optimizer | None = None, device: torch.device | str = "cpu",
                        warmup: Callable[[], object] | None = None) -> int:
    """Measured peak of one training step, comparable to the planner's ``RankMemory.total``.

    Gradients are set to None first (a step creates them). Without ``warmup``: parameters,
    buffers and optimizer state held before + the step's peak allocation. With ``warmup``
    (a step run first, inside the measurement): parameters and buffers + the peak, which
    then includes the optimizer state and whatever else the first step created.
    """
    modules = list(modules)
    for module in modules:
        module.zero_grad(set_to_none=True)
    params = [p for m in modules for p in m.parameters()]
    buffers = [b for m in modules for b in m.buffers()]
    resident = state_bytes(params, None if warmup is not None else optimizer, buffers)
    _, peak = measure_peak_bytes(step, device, before=warmup)
    return resident + peak


def measure_engine_step(engine: HybridEngine, images: Images, labels: Labels, warmup: int = 1) -> int:
    """This rank's measured peak bytes for one ``HybridEngine.train_step`` after ``warmup``
    steps (run inside the measurement, so the optimizer state and the buffers the spatial
    layers keep across steps are counted); comparable to ``RankMemory.total``."""
    def run_warmup() -> None:
        for _ in range(warmup):
            engine.train_step(images, labels)

    modules = [inst.canonical for inst in engine.instances.values()]
    return measure_step_memory(lambda: engine.train_step(images, labels), modules,
                               engine.optimizer, engine.ctx.device, warmup=run_warmup if warmup else None)


def time_engine_steps(engine: HybridEngine, images: Images, labels: Labels, steps: int = 2,
                      warmup: int = 1) -> list[float]:
    """Seconds of each of ``steps`` ``train_step`` calls on this rank (collective: every rank
    calls it; a barrier starts each step together), after ``warmup`` untimed steps."""
    ctx = engine.ctx
    for _ in range(warmup):
        engine.train_step(images, labels)
    seconds = []
    for _ in range(steps):
        ctx.barrier()
        start = time.perf_counter()
        engine.train_step(images, labels)
        seconds.append(time.perf_counter() - start)
    return seconds
