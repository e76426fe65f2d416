"""Job monitor decisions (no MPI): who is named stalled, exempt phases, one failure message, the default timeout."""
from __future__ import annotations

import io
import time

import torch

from mpi4dl_nb.run.monitor import Failure, Goodbye, Heartbeat, JobMonitor, StepTimer, decode, encode_message


class Ctx:
    def __init__(self, world: int, rank: int = 0) -> None:
        self.rank, self.world_size = rank, world
        self.device = torch.device("cpu")


def monitor(world: int = 4, rank: int = 0) -> tuple[JobMonitor, list[int]]:
    aborted: list[int] = []
    mon = JobMonitor(Ctx(world, rank), [], None, stream=io.StringIO(), abort=aborted.append)
    mon.arm(5.0)
    return mon, aborted


def beat(mon: JobMonitor, rank: int, at: float, idle: float, action: str, step: int = 7,
         exempt: bool = False) -> None:
    state = mon.states[rank]
    state.heard, state.idle, state.action, state.step = at, idle, action, step
    state.phase, state.exempt, state.timeout = "training", exempt, 5.0


def test_a_silent_rank_is_named_with_its_action():
    mon, aborted = monitor()
    now = 1000.0
    mon.last_progress, mon.action, mon.step = now - 6, "rank 0 tick 3: recv activation ... from rank 2", 7
    beat(mon, 1, now, 6.5, "rank 1 tick 3: recv gradient of stage 1 ... from rank 2")
    beat(mon, 2, now - 4.0, 2.0, "rank 2 tick 4: forward stage 1 micro-batch 1")   # silent for 4 s
    beat(mon, 3, now, 0.5, "rank 3 tick 2: forward stage 2")
    text = mon.stall(now)
    assert text is not None and "stalled: rank 2 made no progress" in text
    assert "rank 2: no heartbeat (stopped or frozen), idle 6 s, in step 7: rank 2 tick 4: forward" in text
    assert "rank 1: waiting" in text and "rank 3: waiting" in text
    mon._decide(now)
    assert aborted == [4] and "stalled: rank 2" in mon.stream.getvalue()


def test_all_heartbeating_names_the_rank_not_waiting_in_communication():
    mon, _ = monitor(3)
    now = 50.0
    mon.last_progress, mon.action, mon.step = now - 9, "rank 0 tick 1: send activation ... to rank 1", 2
    beat(mon, 1, now, 9.0, "rank 1 tick 2: recv activation ... from rank 0")
    beat(mon, 2, now, 8.0, "rank 2 tick 2: backward stage 1 micro-batch 0")
    assert "stalled: rank 2 made" in mon.stall(now)


def test_no_stall_within_the_timeout_or_while_a_rank_writes_a_checkpoint():
    mon, _ = monitor(2)
    now = 10.0
    mon.last_progress = now - 1
    beat(mon, 1, now, 4.0, "rank 1: recv")
    assert mon.stall(now) is None
    beat(mon, 1, now, 30.0, "writing a checkpoint", exempt=True)
    assert mon.stall(now) is None                      # a long save holds the watchdog off
    beat(mon, 1, now, 30.0, "rank 1: recv")
    assert mon.stall(now) is not None
    mon.arm(None)
    mon.states[1].timeout = None
    assert mon.stall(now) is None                      # not armed (e.g. notebooks, set-up)


def test_arming_starts_the_clock_so_a_long_set_up_is_no_stall():
    """CI, stop 74: a set-up of 11 s on a loaded machine, then ``--step-timeout 3`` armed, was called a stall."""
    mon = JobMonitor(Ctx(1), [], None, stream=io.StringIO(), abort=[].append)
    started = time.monotonic()
    mon.last_progress = started - 11                   # the set-up since the monitor started
    mon.arm(3.0)
    assert mon.stall(started + 1) is None
    mon.arm(3.0)                                       # re-armed after each step: the clock runs on
    assert mon.stall(started + 4) is not None


def test_a_monitor_defers_to_a_lower_live_one():
    mon, _ = monitor(3, rank=1)
    now = 10.0
    mon.states[0].heard = now
    assert not mon.reporter(now)
    mon.states[0].heard = now - 60
    assert mon.reporter(now)


def test_failures_of_several_ranks_give_one_message():
    mon, aborted = monitor(4)
    mon._receive(Failure(2, "ValueError: bad tile", "Traceback ...", "/x/rank2.log"))
    mon._receive(Failure(3, "ValueError: bad tile", "T", None))
    mon._receive(Failure(2, "again", "", None))   # repeated datagram
    assert mon.first_failure is not None
    mon._decide(mon.first_failure + 1.0)
    text = mon.stream.getvalue()
    assert aborted == [1] and text.count("failed:") == 1
    assert "rank 2 failed: ValueError: bad tile" in text and "rank 3 failed too (same error)" in text
    assert "traceback: /x/rank2.log" in text and "Traceback ..." not in text
    mon.verbose = True
    assert "Traceback ..." in mon.failure_message()


def test_datagrams_round_trip_and_other_jobs_are_not_heard():
    messages = [Heartbeat(1, 7, "training", "rank 1: recv", 0.5, False, 60.0), Goodbye(2),
                Failure(3, "ValueError: x", "Traceback ...", None)]
    for message in messages:
        assert decode(encode_message(message, "k1"), "k1") == message
        assert decode(encode_message(message, "k1"), "k2") is None          # another job's key
    assert decode(b"not json", "k1") is None and decode(b'{"t": "other", "key": "k1"}', "k1") is None
    mon, _ = monitor(3)
    mon._receive(decode(encode_message(messages[0], ""), ""))
    assert mon.states[1].action == "rank 1: recv" and mon.states[1].timeout == 60.0
    mon._receive(messages[1])
    assert mon.states[2].closed


def test_default_timeout_from_the_first_steps():
    timer = StepTimer()
    assert timer.timeout() == 1800.0                  # generous until measured
    for seconds in (2.0, 9.0, 3.0, 100.0):
        timer.add(seconds)
    assert timer.timeout() == 90.0                    # 10 x the slowest of the first 3
    timer = StepTimer(seconds=[0.1, 0.1, 0.1])
    assert timer.timeout() == 60.0                    # at least a minute
    assert StepTimer(given=7).timeout() == 7 and StepTimer(given=0).timeout() is None
