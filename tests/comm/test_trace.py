"""The trace keeps a bounded window of steps (and events), aggregates per step and in total as events
arrive, and resolves device stamps lazily (the CUDA clock's call pattern, with a fake clock on CPU)."""

from __future__ import annotations

import pytest

from mpi4dl_nb.comm.trace import Event, StepSummary, Tracer, comm_seconds


def run_steps(tracer: Tracer, steps: int, per_step: int = 3) -> None:
    """``steps`` steps of ``per_step`` events: F (1 s), SEND_ACT (0.5 s, 10 bytes), then extra halos."""
    t = 0.0
    for _ in range(steps):
        tracer.begin_step()
        tracer.record("F", t, t + 1.0, stage=0)
        tracer.record("SEND_ACT", t + 1.0, t + 1.5, bytes=10, peer=1)
        for k in range(per_step - 2):
            tracer.record("halo", t + 0.1 * k, t + 0.1 * k + 0.05, layer="c")
        tracer.end_step()
        t += 2.0


def test_window_keeps_the_last_steps_and_totals_keep_everything():
    tracer = Tracer(window_steps=3)
    run_steps(tracer, 50, per_step=4)
    assert tracer.kept == len(tracer.events) == 3 * 4          # bounded, not 50 * 4
    assert min(e.start for e in tracer.events) == 47 * 2.0      # the last three steps
    totals = tracer.totals()
    assert totals["F"].count == 50 and totals["SEND_ACT"].bytes == 500
    assert totals["halo"].count == 100 and abs(totals["F"].seconds - 50.0) < 1e-9
    assert len(tracer.steps) == 16 and tracer.steps_begun == 50 and tracer.recorded == 200   # history 16
    last = tracer.last_step()
    assert isinstance(last, StepSummary) and last.index == 50 and last.events == 4
    assert last.ops["SEND_ACT"].bytes == 10 and abs(last.seconds - 1.5) < 1e-9
    assert abs(last.comm_seconds - (0.5 + 0.05 + 0.05)) < 1e-9  # halos 0.0-0.05, 0.1-0.15 + send
    assert tracer.summary() == pytest.approx({"F": 3.0, "SEND_ACT": 1.5, "halo": 0.3})


def test_history_and_event_cap_bound_memory_even_without_steps():
    tracer = Tracer(window_steps=None, max_events=25, history=5)
    for i in range(1000):                                       # a notebook's halo calls: no steps
        tracer.record("halo", float(i), i + 0.5)
    assert tracer.kept == 25 and tracer.events[0].start == 975.0
    run_steps(tracer, 20)
    assert tracer.kept == 25 and len(tracer.steps) == 5 and tracer.steps[0].index == 16


def test_since_follows_new_events_across_trimming():
    tracer = Tracer(window_steps=2)
    run_steps(tracer, 5)
    seen = tracer.recorded
    tracer.begin_step()                                         # trims the oldest step
    tracer.record("B", 100.0, 101.0)
    assert [e.op for e in tracer.since(seen)] == ["B"]
    run_steps(tracer, 10)                                       # more than the window since then
    assert len(tracer.since(seen)) == tracer.kept == 2 * 3


def test_unbounded_when_asked_and_clear_keeps_totals():
    tracer = Tracer()
    tracer.configure(window_steps=None, max_events=None)
    assert not tracer.bounded
    run_steps(tracer, 30)
    assert tracer.kept == 90
    tracer.clear()
    assert tracer.kept == 0 and tracer.totals()["F"].count == 30
    with pytest.raises(ValueError, match="positive"):
        tracer.configure(window_steps=0)


def test_disabled_tracer_records_nothing_but_steps_still_summarise():
    tracer = Tracer(enabled=False)
    run_steps(tracer, 3)
    with tracer.span("F") as extra:
        extra["bytes"] = 1
    assert tracer.kept == 0 and tracer.last_step() is not None and tracer.last_step().events == 0


class FakeDeviceClock:
    """Stamps resolved later, as CUDA events are: ``seconds`` may only be asked after ``now`` moved."""

    deferred = True

    def __init__(self) -> None:
        self.time = 0.0
        self.resolved = 0
        self.settled = 0

    def now(self) -> float:
        return self.time

    def stamp(self) -> list[float]:
        return [self.time]

    def seconds(self, stamp: list[float]) -> float:
        self.resolved += 1
        return stamp[0]

    def settle(self) -> None:
        self.settled += 1


def test_device_stamps_resolve_at_step_end_or_when_read():
    clock = FakeDeviceClock()
    tracer = Tracer(clock=clock)       # type: ignore[arg-type]
    tracer.begin_step()
    for op in ("F", "SEND_ACT"):
        with tracer.span(op, stage=1) as extra:
            clock.time += 1.0
            extra["bytes"] = 8
    assert clock.resolved == 0                                  # recording never waits
    summary = tracer.end_step()
    assert clock.resolved == 4 and clock.settled == 1
    assert [(e.op, e.start, e.end, e.bytes, e.stage) for e in tracer.events] == \
        [("F", 0.0, 1.0, 8, 1), ("SEND_ACT", 1.0, 2.0, 8, 1)]
    assert summary.comm_seconds == 1.0 and summary.ops["F"].count == 1
    tracer.record("halo", tracer.stamp(), tracer.stamp())
    assert [e.op for e in tracer.events][-1] == "halo" and clock.settled == 2


def test_since_counts_events_waiting_for_device_stamps_as_before_the_position():
    """Found on an H200: ``recorded`` counted resolved events only, so the events still waiting for their CUDA
    stamps when a position was taken resolved later and came back from ``since`` as new ones."""
    clock = FakeDeviceClock()
    tracer = Tracer(clock=clock)       # type: ignore[arg-type]
    for op in ("halo", "F"):
        tracer.record(op, tracer.stamp(), tracer.stamp())
    seen = tracer.recorded
    assert seen == 2 and clock.resolved == 0                    # taking the position waits for nothing
    tracer.record("ring_send", tracer.stamp(), tracer.stamp(), bytes=64)
    assert [e.op for e in tracer.since(seen)] == ["ring_send"] and tracer.recorded == 3
    tracer.event("SEND_ACT", tracer.stamp(), tracer.stamp(), stage=1, moved=8)
    assert [(e.op, e.bytes) for e in tracer.since(3)] == [("SEND_ACT", 8)]


def test_comm_seconds_counts_overlaps_once():
    events = [Event(0, "halo", 0.0, 1.0), Event(0, "RECV_ACT", 0.5, 2.0), Event(0, "F", 2.0, 5.0),
              Event(0, "ALLREDUCE", 6.0, 6.5)]
    assert comm_seconds(events) == 2.5
