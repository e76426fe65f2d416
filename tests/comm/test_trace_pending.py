"""Device stamps outside any step (an evaluation begins none) do not pile up: past ``PENDING_CHECK`` waiting events the
tracer resolves those the device has finished, asking without waiting (a CUDA event's ``query``), and never waits
for one it has not."""
from __future__ import annotations

from dataclasses import dataclass

from mpi4dl_nb.comm.trace import PENDING_CHECK, Tracer


@dataclass
class Stamp:
    """A fake CUDA event: its time, and whether the device has passed it."""

    time: float
    passed: bool = False


class LaggingDeviceClock:
    """A deferred clock whose device lags the host: a stamp is passed only when ``catch_up`` says so; reading one
    that is not yet passed would wait (counted)."""

    deferred = True

    def __init__(self) -> None:
        self.time = 0.0
        self.stamps: list[Stamp] = []
        self.waits = 0
        self.queries = 0

    def now(self) -> float:
        return self.time

    def stamp(self) -> Stamp:
        self.time += 1.0
        self.stamps.append(Stamp(self.time))
        return self.stamps[-1]

    def catch_up(self, upto: float) -> None:
        for stamp in self.stamps:
            stamp.passed = stamp.passed or stamp.time <= upto

    def done(self, stamp: Stamp) -> bool:
        self.queries += 1
        return stamp.passed

    def seconds(self, stamp: Stamp) -> float:
        if not stamp.passed:
            self.waits += 1
            stamp.passed = True
        return stamp.time

    def settle(self) -> None:
        """Nothing to re-anchor."""


def evaluate(tracer: Tracer, batches: int) -> None:
    """An evaluation's spans: no step begun."""
    for _ in range(batches):
        with tracer.span("F", stage=0):
            pass


def test_waiting_events_stay_bounded_outside_steps_and_finished_ones_resolve_without_a_wait():
    clock = LaggingDeviceClock()
    tracer = Tracer(clock=clock)
    evaluate(tracer, PENDING_CHECK - 1)
    assert len(tracer._pending) == PENDING_CHECK - 1 and clock.queries == 0      # below the bound: nothing asked
    clock.catch_up(upto=clock.time - 20)          # the device is 10 spans behind the host
    for _ in range(20):
        evaluate(tracer, PENDING_CHECK)
        clock.catch_up(upto=clock.time - 20)
        assert len(tracer._pending) <= PENDING_CHECK + 10
    assert clock.waits == 0                       # only finished events were resolved
    assert tracer.recorded == 21 * PENDING_CHECK - 1
    assert clock.queries <= 3 * tracer.recorded   # each event asked about (start and end) about once
    tracer.flush()
    assert [e.start for e in tracer.events[-3:]] == [clock.time - 5, clock.time - 3, clock.time - 1]
    assert tracer.totals()["F"].count == 21 * PENDING_CHECK - 1


def test_a_device_far_behind_is_never_waited_for_before_a_flush():
    clock = LaggingDeviceClock()
    tracer = Tracer(clock=clock)
    evaluate(tracer, 3 * PENDING_CHECK)
    assert clock.waits == 0 and len(tracer._pending) == 3 * PENDING_CHECK
    assert clock.queries <= 3                     # one query per check: the oldest is not finished
    tracer.begin_step()                           # a step boundary resolves everything (waiting)
    assert not tracer._pending and clock.waits > 0
