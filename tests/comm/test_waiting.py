"""How a rank waits: the mode chosen from ranks and cores, the override, and the polling backoff."""

from __future__ import annotations

import time

import pytest

from mpi4dl_nb.comm import waiting
from mpi4dl_nb.comm.waiting import WaitMode, poll, wait_mode_for


def test_auto_yields_exactly_when_ranks_outnumber_cores_or_the_cores_are_busy(monkeypatch):
    monkeypatch.delenv(waiting.ENV_VAR, raising=False)
    assert wait_mode_for(3, cores=2, load=0.0) is WaitMode.YIELD
    assert wait_mode_for(2, cores=2, load=0.0) is WaitMode.BLOCK
    assert wait_mode_for(1, cores=8, load=7.5) is WaitMode.BLOCK
    assert wait_mode_for(9, cores=8, requested="auto", load=0.0) is WaitMode.YIELD
    assert wait_mode_for(2, cores=2, load=2.0) is WaitMode.YIELD   # a shared node: other jobs fill the cores
    monkeypatch.setattr(waiting.os, "getloadavg", lambda: (0.3, 0.2, 0.1))   # the node's load when not given
    assert wait_mode_for(2, cores=2) is WaitMode.BLOCK
    monkeypatch.setattr(waiting.os, "getloadavg", lambda: (20.0, 18.0, 15.0))
    assert wait_mode_for(2, cores=2) is WaitMode.YIELD


def test_requested_mode_and_environment_override_auto(monkeypatch):
    monkeypatch.setenv(waiting.ENV_VAR, "block")
    assert wait_mode_for(9, cores=2, load=30.0) is WaitMode.BLOCK
    assert wait_mode_for(9, cores=2, requested="yield") is WaitMode.YIELD   # argument beats the variable
    monkeypatch.setenv(waiting.ENV_VAR, "yield")
    assert wait_mode_for(1, cores=2) is WaitMode.YIELD


def test_unknown_mode_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.setenv(waiting.ENV_VAR, "spin")
    with pytest.raises(ValueError, match="auto, block or yield"):
        wait_mode_for(2, cores=2)


def test_poll_backs_off_and_stops_when_done():
    answers = iter([False] * 6 + [True])
    start = time.perf_counter()
    pauses = poll(lambda: next(answers), first=1e-4, longest=4e-4)
    elapsed = time.perf_counter() - start
    assert pauses == 6
    # pauses 0.1, 0.2, 0.4, 0.4, 0.4, 0.4 ms: at least their sum, and not a blocking hang
    assert 1.9e-3 <= elapsed < 0.5
    assert poll(lambda: True) == 0
