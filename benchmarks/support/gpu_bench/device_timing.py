"""Seconds of a call on a device: CUDA events around each call on a GPU (kernel time, one sync at the end), the
wall clock elsewhere; the median after a warm-up."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from ..timing import seconds_of


def _cuda_seconds(run: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls between CUDA events on the current stream."""
    marks = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        marks.append((start, end))
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in marks]


def median_seconds(run: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """The median seconds of ``run()`` on ``device`` over ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return statistics.median(_cuda_seconds(run, repeats))
    return statistics.median(seconds_of(run) for _ in range(repeats))
