"""Every rank's trace window gathered to one rank as one timeline, clocks aligned at a barrier."""
from __future__ import annotations

from dataclasses import replace

from .protocol import Comm
from .trace import Event


def merge_timelines(per_rank: list[list[Event]]) -> list[Event]:
    """One timeline from every rank's events, ordered by start time."""
    merged = [event for events in per_rank for event in events]
    merged.sort(key=lambda e: (e.start, e.rank))
    return merged


def gather_timeline(ctx: Comm, root: int = 0, clear: bool = False) -> list[Event] | None:
    """Every rank's window of events as one timeline on ``root`` (None elsewhere); collective.

    Clocks are aligned at a barrier: each rank's times are shifted so that the moment it
    leaves the barrier is the same instant on all ranks (good to the barrier's skew).
    """
    tracer = ctx.tracer
    tracer.flush()
    ctx.barrier()
    sync = tracer.now()
    shifted = [replace(e, start=e.start - sync, end=e.end - sync) for e in tracer.events]
    if clear:
        tracer.clear()
    gathered = ctx.gather_object(shifted, root=root)
    if gathered is None:
        return None
    merged = merge_timelines(gathered)
    if merged:
        zero = min(e.start for e in merged)
        merged = [replace(e, start=e.start - zero, end=e.end - zero) for e in merged]
    return merged
