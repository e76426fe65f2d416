"""A lost host (run/lost_host.py, run/monitor.py, run/teardown.py; no MPI): monitors spread over hosts, a host counted
lost only when all its ranks fall silent, one message naming it, exit code 6, also in the teardown after the summary
(issue 51; the launch across test hosts: tests/multihost/test_host_lost.py); tracebacks never land in the working
directory."""
from __future__ import annotations

import io
import socket
import tempfile
from pathlib import Path

import pytest
import torch

from mpi4dl_nb.comm.finalize import loaded_mpi_library
from mpi4dl_nb.run import teardown
from mpi4dl_nb.run.lost_host import LOST_HOST_SECONDS, choose_monitors, ended_before, lost_hosts
from mpi4dl_nb.run.monitor import (
    COLLECTIVE_FINALIZE_SECONDS,
    EXIT_HOST_LOST,
    FINALIZING,
    Failure,
    JobMonitor,
    write_log,
)


class Ctx:
    def __init__(self, world: int, rank: int = 0) -> None:
        self.rank, self.world_size = rank, world
        self.device = torch.device("cpu")


def test_monitors_sit_on_different_hosts():
    assert choose_monitors(["a"] * 5, 3) == [0, 1, 2]                       # one host: the first three
    assert choose_monitors(["a", "a", "a", "b", "b", "b"], 3) == [0, 1, 3]  # block placement: one on b
    assert choose_monitors(["a", "b", "c", "d"], 3) == [0, 1, 2]
    assert choose_monitors(["a", "b"], 3) == [0, 1]


def test_a_host_is_lost_only_when_all_its_ranks_are_silent():
    hosts = ["a", "b", "a", "b"]
    silent = {0: 0.0, 1: 40.0, 2: 1.0, 3: 35.0}
    assert lost_hosts(hosts, "a", silent.get, 30.0) == {"b": [1, 3]}
    silent[3] = 1.0                                   # one rank of b still beats: a stalled process, not a lost host
    assert lost_hosts(hosts, "a", silent.get, 30.0) == {}
    assert lost_hosts(hosts, "a", {0: 0.0, 1: None, 2: 0.0, 3: None}.get, 30.0) == {}     # b's ranks said goodbye
    assert lost_hosts(["a", "a"], "a", {0: 0.0, 1: 99.0}.get, 30.0) == {}                  # one host: never


def monitor_across(hosts: list[str], rank: int = 0) -> tuple[JobMonitor, list[int]]:
    aborted: list[int] = []
    mon = JobMonitor(Ctx(len(hosts), rank), [], None, stream=io.StringIO(), abort=aborted.append, hosts=hosts)
    return mon, aborted


def test_the_job_ends_naming_the_lost_host_without_a_step_timeout():
    mon, aborted = monitor_across(["h1", "h2", "h1"])
    now = 1000.0
    mon.step, mon.action = 3, "rank 0 tick 3: backward stage 0"
    for rank in (1, 2):
        mon.states[rank].heard, mon.states[rank].step = now, 3
    mon._decide(now + LOST_HOST_SECONDS - 1)
    assert aborted == []
    mon.states[2].heard = now + LOST_HOST_SECONDS + 1          # rank 2 (h1) beats on, rank 1 (h2) went silent
    mon._decide(now + LOST_HOST_SECONDS + 1)
    text = mon.stream.getvalue()
    assert aborted == [EXIT_HOST_LOST] and text.count("lost host h2 (rank 1)") == 1, text
    assert "rank 1 (h2): lost with its host" in text and "rank 2 (h1): alive" in text


def test_an_armed_step_timeout_shortens_the_wait_and_a_silent_host_is_no_stall():
    mon, aborted = monitor_across(["h1", "h2"])
    mon.arm(5.0)
    mon.last_progress = 103.0
    state = mon.states[1]
    state.heard, state.idle, state.timeout, state.step = 100.0, 3.0, 5.0, 2    # idle 3 s when last heard
    mon._decide(104.0)                 # idle 7 s > the timeout, but silent only 4 s: not yet, and no stall
    assert aborted == []
    mon._decide(105.5)
    assert aborted == [EXIT_HOST_LOST] and "lost host h2" in mon.stream.getvalue()


def test_tracebacks_go_to_the_run_directory_or_the_temporary_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    into_run = write_log(tmp_path / "ck", 1, "trace")
    assert into_run is not None and into_run.parent == tmp_path / "ck"
    elsewhere = write_log(None, 2, "trace")
    try:
        assert elsewhere is not None and elsewhere.parent == Path(tempfile.gettempdir())
        assert not list(tmp_path.glob("mpi4dl_nb-error-*"))           # never the working directory
    finally:
        if elsewhere is not None:
            elsewhere.unlink()


def test_the_failure_message_says_on_which_host_the_traceback_is():
    mon, _ = monitor_across(["h1", "h2"])
    mon.failures = [Failure(1, "ValueError: bad tile", "trace", "/tmp/mpi4dl_nb-error-x-rank1.log")]
    assert "traceback: /tmp/mpi4dl_nb-error-x-rank1.log on h2" in mon.failure_message()


def test_monitors_end_one_after_another_the_first_last():
    hosts = ["h1", "h2", "h1"]                                   # monitors 0 (h1), 1 (h2), 2 (h1)
    assert [ended_before(hosts, [0, 1, 2], r) for r in range(3)] == [[1], [2], []]
    block = ["a", "a", "a", "b", "b", "b"]                       # monitors 0, 1 (a) and 3 (b)
    assert [ended_before(block, [0, 1, 3], r) for r in (0, 1, 3)] == [[3, 4, 5], [3, 4, 5], [2]]
    assert ended_before(["a"] * 4, [0, 1, 2], 0) == []             # one host: nobody to outlast


def test_a_host_lost_in_the_teardown_is_named_as_such():
    mon, aborted = monitor_across(["h1", "h2", "h1"])
    mon.tearing_down, now = True, 1000.0
    mon.states[1].heard, mon.states[1].phase = now, "teardown"
    mon.states[2].heard = now + LOST_HOST_SECONDS + 1             # rank 2 (h1) beats on, rank 1 (h2) went silent
    mon._decide(now + LOST_HOST_SECONDS + 1)
    text = mon.stream.getvalue()
    assert aborted == [EXIT_HOST_LOST] and text.count("lost host h2 (rank 1)") == 1, text
    assert "after the job's summary, in MPI's teardown" in text and "the job had finished" in text
    assert "--resume" not in text                                  # nothing to rerun: the job's results are complete


def test_a_monitor_outlasts_a_rank_until_its_goodbye_or_a_collective_finalize():
    mon, _ = monitor_across(["h1", "h2"])
    state, now = mon.states[1], 100.0
    state.heard, state.phase, state.phase_since = now, FINALIZING, now - 1.0
    assert not mon._ended(state, now)                              # in a local finalize: its goodbye comes soon
    state.phase_since = now - COLLECTIVE_FINALIZE_SECONDS - 1.0
    assert mon._ended(state, now)                                  # alive in it for long: it waits for this rank
    assert not mon._ended(state, now + 10.0)                       # silent in it: not ended (lost, in time)
    state.closed = True
    assert mon._ended(state, now + 10.0)


@pytest.fixture
def watched(monkeypatch):
    """The teardown watch of a batch process (``exit_watched`` asks for it), reset afterwards."""
    monkeypatch.setattr(teardown, "_WATCH", teardown._Watch(enabled=True, registered=True))
    monkeypatch.setattr(teardown, "loaded_mpi_library", lambda: "/usr/lib/libmpi.so.12")
    return teardown._WATCH


def listening_monitor(hosts: list[str]) -> JobMonitor:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    peers = [sock.getsockname()] * len(hosts)
    return JobMonitor(Ctx(len(hosts)), peers, sock, stream=io.StringIO(), abort=lambda code: None, hosts=hosts)


def test_a_closed_monitor_lingers_through_the_teardown_of_a_batch_process(watched):
    first, second = listening_monitor(["h1", "h2"]), listening_monitor(["h1", "h2"])
    first.arm(5.0)
    first.close()
    assert watched.monitor is first and first.tearing_down and not first._stop.is_set()
    assert first.timeout is None and first.exempt and first.phase_name == "teardown"    # no stall now
    second.close()                             # the next job of the process (--folds): the first one ends
    assert watched.monitor is second and first._stop.is_set() and not second._stop.is_set()
    teardown._WATCH.monitor = None
    second.end()


def test_a_closed_monitor_ends_at_once_elsewhere():
    mon = listening_monitor(["h1", "h2"])            # a notebook engine, a script: nothing watches the teardown
    mon.close()
    assert mon._stop.is_set() and not mon.tearing_down


def test_the_mpi_library_is_found_in_the_process_map_and_exit_codes_are_kept():
    maps = ("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
            "7f02-7f03 r-xp 00000000 08:01 2 /venv/lib/libmpi.so.12\n7f04-7f05 rw-p 00000000 00:00 0\n")
    assert loaded_mpi_library(maps) == "/venv/lib/libmpi.so.12"
    assert loaded_mpi_library("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libmpich_f.so\n") is None
    assert [teardown.system_exit_code(SystemExit(c)) for c in (None, 0, 2, 6)] == [0, 0, 2, 6]
    assert teardown.system_exit_code(SystemExit("refused")) == 1
