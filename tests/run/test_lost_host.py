"""A lost host (run/lost_host.py, run/monitor.py; no MPI): monitors spread over hosts, a host counted lost only when all
its ranks fall silent, one message naming it, exit code 6; tracebacks never land in the working directory."""
from __future__ import annotations

import io
import tempfile
from pathlib import Path

import torch

from mpi4dl_nb.run.lost_host import LOST_HOST_SECONDS, choose_monitors, lost_hosts
from mpi4dl_nb.run.monitor import EXIT_HOST_LOST, Failure, JobMonitor, write_log


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
