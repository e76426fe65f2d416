"""Per-rank event trace: what each rank did, when, with whom, and how many bytes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .protocol import Comm


@dataclass
class Event:
    """One traced operation on one rank (times in seconds since the tracer started)."""

    rank: int
    op: str
    start: float
    end: float
    stage: int | None = None
    micro_batch: int | None = None
    replica: int | None = None
    bytes: int = 0
    peer: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Tracer:
    """Records Events for one rank; disabled tracers cost one attribute check."""

    def __init__(self, rank: int = 0, enabled: bool = True, origin: float | None = None) -> None:
        self.rank = rank
        self.enabled = enabled
        self.origin = time.perf_counter() if origin is None else origin
        self.events: list[Event] = []

    def now(self) -> float:
        return time.perf_counter() - self.origin

    @contextmanager
    def span(self, op: str, **fields: Any) -> Iterator[dict[str, Any]]:
        """Time the body as one event; the yielded dict may add fields (e.g. bytes)."""
        if not self.enabled:
            yield {}
            return
        extra: dict[str, Any] = {}
        start = self.now()
        try:
            yield extra
        finally:
            self.record(op, start, self.now(), **fields, **extra)

    def record(self, op: str, start: float, end: float, **fields: Any) -> None:
        """Add a finished event."""
        if not self.enabled:
            return
        known = {k: fields.pop(k) for k in ("stage", "micro_batch", "replica", "bytes", "peer")
                 if k in fields}
        self.events.append(Event(self.rank, op, start, end, **known, extra=fields))

    def clear(self) -> None:
        self.events.clear()

    def summary(self) -> dict[str, float]:
        """Total seconds per op name."""
        totals: dict[str, float] = {}
        for event in self.events:
            totals[event.op] = totals.get(event.op, 0.0) + event.duration
        return totals


def merge_timelines(per_rank: list[list[Event]]) -> list[Event]:
    """One timeline from every rank's events, ordered by start time."""
    merged = [event for events in per_rank for event in events]
    merged.sort(key=lambda e: (e.start, e.rank))
    return merged


def gather_timeline(ctx: Comm, root: int = 0, clear: bool = False) -> list[Event] | None:
    """Every rank's events as one timeline on ``root`` (None elsewhere); collective.

    Clocks are aligned at a barrier: each rank's times are shifted so that the moment it
    leaves the barrier is the same instant on all ranks (good to the barrier's skew).
    """
    from dataclasses import replace

    ctx.barrier()
    sync = ctx.tracer.now()
    shifted = [replace(e, start=e.start - sync, end=e.end - sync) for e in ctx.tracer.events]
    if clear:
        ctx.tracer.clear()
    gathered = ctx.gather_object(shifted, root=root)
    if gathered is None:
        return None
    merged = merge_timelines(gathered)
    if merged:
        zero = min(e.start for e in merged)
        merged = [replace(e, start=e.start - zero, end=e.end - zero) for e in merged]
    return merged
