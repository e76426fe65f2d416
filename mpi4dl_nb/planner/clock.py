"""The clock the planner times layers by: a CPU thread's own seconds on one thread, else wall seconds."""

from __future__ import annotations

import time

import torch


def work_clock(device: torch.device | str) -> float:
    """A reading of the clock layers are timed by on ``device``: on a CPU running one torch thread, this thread's
    CPU seconds (what the work takes on a core of its own, as each rank has one, whatever else shares this
    machine meanwhile); otherwise wall seconds, the device's queued work (CUDA) waited for first."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time()
    return time.perf_counter()
