"""Per-rank event trace: a bounded window of the last steps' events, plus per-step and running totals.

A run lasts days, so the trace keeps only the events of the last ``window_steps`` steps
(and never more than ``max_events``); what the metrics need is aggregated as events
arrive: per-op totals since the start (``totals()``) and one ``StepSummary`` per step
(``steps``, ``last_step()``: per-op totals and communication time). ``configure(None,
None)`` keeps every event (unbounded: for short runs only).

Times are seconds since the tracer started. On CPU they are host timestamps; on a GPU
(``CudaClock``) a span records CUDA events on the current stream, so it measures when the
kernels ran, not when they were launched; such events are resolved (one wait on the last
event) at ``end_step()`` or when ``events`` is read.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, TypeAlias

if TYPE_CHECKING:
    import torch

Stamp: TypeAlias = "float | torch.cuda.Event"   # a point in time: host seconds, or a CUDA event
TraceValue = int | float | str | tuple[int, ...] | None   # the value of an event's field

DEFAULT_WINDOW_STEPS = 4        # steps whose events the trace keeps
DEFAULT_MAX_EVENTS = 20_000     # hard cap, also for events recorded outside any step
DEFAULT_HISTORY = 16            # StepSummary records kept (the last ones: what metrics read)
PENDING_CHECK = 256             # events waiting for device stamps before those already finished are resolved

COMM_WORDS = ("send", "recv", "halo", "reduce", "broadcast", "bcast", "gather", "scatter",
              "handoff", "barrier", "wait", "exchange", "comm")


@functools.lru_cache(maxsize=1024)
def is_communication(op: str) -> bool:
    """Whether a trace op name is communication (send/recv/halo/all-reduce/...); cached: a step asks it of
    every event, and a run has a few dozen op names."""
    name = op.lower()
    return any(word in name for word in COMM_WORDS)


def comm_seconds(events: Iterable[Event]) -> float:
    """Time covered by communication events (overlapping spans counted once)."""
    spans = sorted((e.start, e.end) for e in events if is_communication(e.op))
    total = 0.0
    cur_start = cur_end = None
    for start, end in spans:
        if cur_end is None or start > cur_end:
            if cur_start is not None and cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_start is not None and cur_end is not None:
        total += cur_end - cur_start
    return total


@dataclass(slots=True)
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
    extra: dict[str, TraceValue] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start

    def as_dict(self) -> dict[str, TraceValue | dict[str, TraceValue]]:
        return asdict(self)


@dataclass
class OpTotal:
    """How often an op ran, for how long and how many bytes it moved."""

    count: int = 0
    seconds: float = 0.0
    bytes: int = 0

    def add(self, event: Event) -> None:
        self.count += 1
        self.seconds += event.duration
        self.bytes += event.bytes


@dataclass(frozen=True)
class StepSummary:
    """Aggregates of one traced step: per-op totals, its time span and its communication time."""

    index: int
    start: float
    end: float
    events: int
    ops: dict[str, OpTotal]
    comm_seconds: float

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)

    @classmethod
    def of(cls, index: int, events: list[Event]) -> StepSummary:
        ops: dict[str, OpTotal] = {}
        for event in events:
            total = ops.get(event.op)
            if total is None:
                total = ops[event.op] = OpTotal()
            total.add(event)
        start = min((e.start for e in events), default=0.0)
        end = max((e.end for e in events), default=start)
        return cls(index, start, end, len(events), ops, comm_seconds(events))


class Clock(Protocol):
    """Where a tracer's times come from."""

    def stamp(self) -> Stamp:
        """A point in time, taken without waiting for the device."""
        ...

    def seconds(self, stamp: Stamp) -> float:
        """``stamp`` as seconds since the tracer's origin (may wait for the device)."""
        ...

    def now(self) -> float:
        """Host seconds since the tracer's origin."""
        ...

    def settle(self) -> None:
        """Called once every pending stamp has been resolved (a clock may re-anchor itself)."""
        ...

    def done(self, stamp: Stamp) -> bool:
        """Whether ``seconds(stamp)`` would not wait (the device has passed it); never waits itself."""
        ...


class HostClock:
    """Host timestamps (``time.perf_counter``): what CPU work takes."""

    deferred = False

    def __init__(self, origin: float) -> None:
        self.origin = origin

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def stamp(self) -> float:
        return self.now()

    def seconds(self, stamp: Stamp) -> float:
        if not isinstance(stamp, (int, float)):
            raise TypeError(f"a host clock's stamps are seconds, got {type(stamp).__name__}")
        return float(stamp)

    def settle(self) -> None:
        """Host stamps need no settling."""

    def done(self, stamp: Stamp) -> bool:
        return True   # host seconds: known at once


class CudaClock:
    """CUDA events recorded on the current stream: when the kernels ran, not when they were launched.

    A reference event recorded (and waited for) at a known host time anchors the events'
    ``elapsed_time`` in the host time base; ``settle`` re-anchors it after every resolve so
    drift between the clocks stays within one step.
    """

    deferred = True

    def __init__(self, device: torch.device, origin: float) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.origin = origin
        self.settle()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def stamp(self) -> torch.cuda.Event:
        event = self.torch.cuda.Event(enable_timing=True)
        event.record(self.torch.cuda.current_stream(self.device))
        return event

    def seconds(self, stamp: Stamp) -> float:
        if isinstance(stamp, (int, float)):   # host seconds since the origin (``record``'s floats)
            return float(stamp)
        stamp.synchronize()
        return self.reference_time + self.reference.elapsed_time(stamp) / 1e3

    def done(self, stamp: Stamp) -> bool:
        return isinstance(stamp, (int, float)) or bool(stamp.query())

    def settle(self) -> None:
        self.reference = self.stamp()
        self.reference.synchronize()
        self.reference_time = self.now()


class Tracer:
    """Records Events for one rank in a bounded window; disabled tracers cost one attribute check.

    ``begin_step``/``end_step`` mark training steps (the pipeline runtime calls them): the
    window holds the events of the last ``window_steps`` steps; events recorded outside a
    step join the current bucket. ``max_events`` caps the window whatever happens.
    """

    def __init__(self, rank: int = 0, enabled: bool = True, origin: float | None = None, *,
                 window_steps: int | None = DEFAULT_WINDOW_STEPS,
                 max_events: int | None = DEFAULT_MAX_EVENTS, history: int = DEFAULT_HISTORY,
                 clock: HostClock | CudaClock | None = None) -> None:
        self.rank = rank
        self.enabled = enabled
        self.origin = time.perf_counter() if origin is None else origin
        self.clock: HostClock | CudaClock = HostClock(self.origin) if clock is None else clock
        self.window_steps = window_steps
        self.max_events = max_events
        self._buckets: deque[list[Event]] = deque([[]])   # oldest first; the last is current
        self._count = 0
        self._pending: list[tuple[str, Stamp, Stamp, dict[str, TraceValue]]] = []
        self._check_at = PENDING_CHECK    # pending events at which the finished ones are resolved (no wait)
        self._in_step = False
        self._resolved = 0                # events ever kept (pending ones not yet)
        self.steps_begun = 0
        self.steps: deque[StepSummary] = deque(maxlen=history)
        self._totals: dict[str, OpTotal] = {}
        self.configure(window_steps, max_events)

    # ------------------------------------------------------------- configuration
    def configure(self, window_steps: int | None = DEFAULT_WINDOW_STEPS,
                  max_events: int | None = DEFAULT_MAX_EVENTS) -> None:
        """Keep the events of the last ``window_steps`` steps, at most ``max_events`` (None: no bound)."""
        for name, value in (("window_steps", window_steps), ("max_events", max_events)):
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}: use a positive number, or None for no bound")
        self.window_steps = window_steps
        self.max_events = max_events
        self._trim()

    @property
    def bounded(self) -> bool:
        return self.window_steps is not None or self.max_events is not None

    # ----------------------------------------------------------------- recording
    def now(self) -> float:
        """Host seconds since the tracer started."""
        return self.clock.now()

    def stamp(self) -> Stamp:
        """A point in time for ``record`` (a CUDA event on GPU, seconds on CPU)."""
        return self.clock.stamp()

    @contextmanager
    def span(self, op: str, **fields: TraceValue) -> Iterator[dict[str, TraceValue]]:
        """Time the body as one event; the yielded dict may add fields (e.g. bytes)."""
        if not self.enabled:
            yield {}
            return
        extra: dict[str, TraceValue] = {}
        start = self.clock.stamp()
        try:
            yield extra
        finally:
            self.record(op, start, self.clock.stamp(), **fields, **extra)

    def record(self, op: str, start: Stamp, end: Stamp, **fields: TraceValue) -> None:
        """Add a finished event between two stamps (``stamp()``, or seconds on a host clock)."""
        if not self.enabled:
            return
        if self.clock.deferred:
            self._defer((op, start, end, fields))
            return
        self._add(op, self.clock.seconds(start), self.clock.seconds(end), fields)

    def event(self, op: str, start: Stamp, end: Stamp, stage: int | None = None, micro_batch: int | None = None,
              replica: int | None = None, peer: int | None = None, moved: int = 0,
              extra: dict[str, TraceValue] | None = None) -> None:
        """``record`` for a caller that has the fields at hand (the pipeline's actions): no keyword parsing."""
        if not self.enabled:
            return
        if self.clock.deferred:
            fields: dict[str, TraceValue] = {"stage": stage, "micro_batch": micro_batch, "replica": replica,
                                             "peer": peer, "bytes": moved, **(extra or {})}
            self._defer((op, start, end, fields))
            return
        self._keep(Event(self.rank, op, self.clock.seconds(start), self.clock.seconds(end), stage, micro_batch,
                         replica, moved, peer, extra if extra is not None else {}))

    def _add(self, op: str, start: float, end: float, fields: dict[str, TraceValue]) -> None:
        def index(name: str) -> int | None:   # the named fields are numbers (or None)
            value = fields.pop(name, None)
            if isinstance(value, tuple):
                raise TypeError(f"trace field {name}={value!r}: give a number")
            return None if value is None else int(value)

        self._keep(Event(self.rank, op, start, end, stage=index("stage"), micro_batch=index("micro_batch"),
                         replica=index("replica"), bytes=index("bytes") or 0, peer=index("peer"), extra=fields))

    def _keep(self, event: Event) -> None:
        op = event.op
        self._buckets[-1].append(event)
        self._count += 1
        self._resolved += 1
        total = self._totals.get(op)    # no OpTotal made per event (setdefault would)
        if total is None:
            total = self._totals[op] = OpTotal()
        total.add(event)
        if self.max_events is not None and self._count > self.max_events:
            self._trim()

    def _defer(self, entry: tuple[str, Stamp, Stamp, dict[str, TraceValue]]) -> None:
        """Keep an event until its device stamps resolve; past ``PENDING_CHECK`` more, resolve the finished ones
        (an evaluation begins no step: its events would otherwise wait, unbounded, for one long sync)."""
        self._pending.append(entry)
        if len(self._pending) >= self._check_at:
            done = next((i for i, (_, start, end, _) in enumerate(self._pending)
                         if not (self.clock.done(start) and self.clock.done(end))), len(self._pending))
            self._resolve(done)

    def _resolve(self, count: int) -> None:
        """Resolve the oldest ``count`` waiting events, in order (waits for any the device has not passed)."""
        ready, self._pending = self._pending[:count], self._pending[count:]
        self._check_at = len(self._pending) + PENDING_CHECK
        for op, start, end, fields in ready:
            self._add(op, self.clock.seconds(start), self.clock.seconds(end), fields)

    def flush(self) -> None:
        """Resolve events still waiting for their device stamps (waits for the last one)."""
        if not self._pending:
            return
        self._resolve(len(self._pending))
        self.clock.settle()

    # --------------------------------------------------------------------- steps
    def begin_step(self) -> None:
        """A training step starts: its events form a new bucket; the oldest beyond the window go."""
        self.flush()
        self.steps_begun += 1
        if self._buckets[-1] or self._in_step:
            self._buckets.append([])
        self._in_step = True
        self._trim()

    def end_step(self) -> StepSummary:
        """The step ended: summarise its events (kept in ``steps``) and return the summary."""
        self.flush()
        summary = StepSummary.of(self.steps_begun, self._buckets[-1])
        if self._in_step:
            self.steps.append(summary)
        self._in_step = False
        return summary

    def last_step(self) -> StepSummary | None:
        """The summary of the last finished step (None before the first)."""
        return self.steps[-1] if self.steps else None

    def _trim(self) -> None:
        keep = None if self.window_steps is None else self.window_steps
        while keep is not None and len(self._buckets) > keep:
            self._count -= len(self._buckets.popleft())
        while self.max_events is not None and self._count > self.max_events:
            oldest = self._buckets[0]
            drop = min(len(oldest), self._count - self.max_events)
            del oldest[:drop]
            self._count -= drop
            if not oldest and len(self._buckets) > 1:
                self._buckets.popleft()

    # ------------------------------------------------------------------ reading
    @property
    def recorded(self) -> int:
        """Events ever recorded, those still waiting for their device stamps included (a position for
        ``since``: an event recorded before it never counts as after it, however late its stamps resolve)."""
        return self._resolved + len(self._pending)

    @property
    def events(self) -> list[Event]:
        """The window's events, oldest first (a new list)."""
        self.flush()
        return [event for bucket in self._buckets for event in bucket]

    def since(self, position: int) -> list[Event]:
        """Events recorded since ``recorded`` was ``position`` (those still in the window)."""
        self.flush()
        return self.events[max(0, self._count - (self.recorded - position)):]

    @property
    def kept(self) -> int:
        """How many events the window holds now."""
        self.flush()
        return self._count

    def clear(self) -> None:
        """Drop the window's events (the running totals and step summaries stay)."""
        self.flush()
        self._buckets = deque([[]])
        self._count = 0

    def summary(self) -> dict[str, float]:
        """Total seconds per op name over the window."""
        totals: dict[str, float] = {}
        for event in self.events:
            totals[event.op] = totals.get(event.op, 0.0) + event.duration
        return totals

    def totals(self) -> dict[str, OpTotal]:
        """Count, seconds and bytes per op since the tracer started (never trimmed)."""
        self.flush()
        return {op: replace(total) for op, total in self._totals.items()}
