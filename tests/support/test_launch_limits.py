"""pytest's time limit of a test that may run a shared launch (tests/conftest.py): the longest launch's own limit."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tests.conftest import limit_shared_launches
from tests.support.battery import Job


@dataclass
class FakeItem:
    fixturenames: tuple[str, ...]
    markers: list[pytest.Mark] = field(default_factory=list)

    def add_marker(self, marker: pytest.MarkDecorator) -> None:
        self.markers.append(marker.mark)


def test_a_test_asking_for_a_shared_launch_gets_the_sum_of_the_longest_launch_s_job_limits(monkeypatch):
    registered = {(5, "mpi"): [Job(5, "mpi", "a", (), 600), Job(5, "mpi", "b", (), 700)],
                  (2, "mpi"): [Job(2, "mpi", "c", (), 900)]}
    monkeypatch.setattr("tests.conftest.REGISTERED", registered)
    asks, plain = FakeItem(("shared_launch", "tmp_path")), FakeItem(("mpirun",))
    limit_shared_launches([asks, plain])
    assert [mark.args for mark in asks.markers if mark.name == "timeout"] == [(600 + 700 + 120,)]
    assert plain.markers == []
