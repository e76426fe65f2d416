"""comm/agreement.py: every rank goes on, or every rank stops with the same one message."""

from __future__ import annotations

import pytest

from mpi4dl_nb.comm.agreement import SetupFailed, agreed, failure_text, joined_failures
from mpi4dl_nb.errors import ConfigError


class GatheredWorld:
    """A rank of a world whose other ranks reported ``others`` (their failure texts) to all_gather_object."""

    def __init__(self, rank: int, others: dict[int, str | None], size: int) -> None:
        self.rank, self.others, self.world_size = rank, others, size
        self.gathered: list[str | None] = []

    def all_gather_object(self, obj: str | None) -> list[str | None]:
        self.gathered = [obj if r == self.rank else self.others.get(r) for r in range(self.world_size)]
        return self.gathered


def test_success_everywhere_returns_what_was_built() -> None:
    world = GatheredWorld(1, {}, 3)
    assert agreed(world, lambda: 42) == 42
    assert world.gathered == [None, None, None]


def test_a_failure_elsewhere_stops_this_rank_too() -> None:
    world = GatheredWorld(0, {2: "slide.svs: no such file"}, 3)
    with pytest.raises(SetupFailed, match=r"^on rank 2: slide.svs: no such file$"):
        agreed(world, lambda: 1)


def test_the_same_failure_on_every_rank_is_one_message_without_ranks() -> None:
    world = GatheredWorld(0, {1: "--mpp: must be > 0"}, 2)

    def refuse() -> None:
        raise ConfigError("--mpp", "must be > 0")

    with pytest.raises(SetupFailed, match=r"^--mpp: must be > 0$"):
        agreed(world, refuse)


def test_a_crash_is_named_by_its_type_and_its_traceback_printed(capsys: pytest.CaptureFixture[str]) -> None:
    world = GatheredWorld(0, {}, 1)

    def crash() -> None:
        raise RuntimeError("boom")

    with pytest.raises(SetupFailed, match=r"^RuntimeError: boom$"):
        agreed(world, crash)
    assert "Traceback" in capsys.readouterr().err


def test_failures_grouped_by_text() -> None:
    assert joined_failures([None, None]) is None
    assert joined_failures(["x", None]) == "x"                       # rank 0 alone: a rank-0 check
    assert joined_failures([None, "a", "a", "b"]) == "on ranks 1, 2: a; on rank 3: b"
    assert failure_text(KeyError("no key")) == "no key"
    assert failure_text(TypeError("t")) == "TypeError: t"
