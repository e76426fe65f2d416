"""The clock the planner times layers by: a CPU thread's own seconds on one thread, else wall seconds."""

from __future__ import annotations

import time

import torch


def on_wall_clock(device: torch.device | str) -> bool:
    """Whether ``work_clock`` reads wall seconds on ``device`` (a CUDA device, or a CPU running more than one torch
    thread), which count what else runs on the machine meanwhile."""
    return not (torch.device(device).type == "cpu" and torch.get_num_threads() == 1)


def work_clock(device: torch.device | str) -> float:
    """A reading of the clock layers are timed by on ``device``: on a CPU running one torch thread, this thread's
    CPU seconds (what the work takes on a core of its own, as each rank has one, whatever else shares this
    machine meanwhile); otherwise wall seconds, the device's queued work (CUDA) waited for first."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if not on_wall_clock(device):
        return time.thread_time()
    return time.perf_counter()
