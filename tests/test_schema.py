"""schema.py and cli/job_flags.py: one field table gives the parser and the keyword builder, and both build the
same job."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mpi4dl_nb.cli.job_flags import add_job_flags, keyword_values
from mpi4dl_nb.cli.parser import CommandParser
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.schema import Bounds, build_job, check_bounds, flag, flag_fields, flags_by_dest, number, whole_number


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(","))


@dataclass(frozen=True)
class Inner:
    batch_size: int = flag("--batch-size", "global batch", 32, parse=whole_number, group="data", bounds=Bounds(1))
    progress: bool = flag("--no-progress", "no progress bar", True, switch=True)
    tags: tuple[str, ...] = flag("--tag", "repeatable", (), repeat=True, dest="tags")
    rate: float = flag("--rate", "a share", 0.5, parse=number, bounds=Bounds(0, 1, closed=False), hidden=True)

    def __post_init__(self) -> None:
        check_bounds(self)


@dataclass(frozen=True)
class Job:
    checkpoint: str = flag("--checkpoint", "the file")
    mode: str = flag("--mode", "how", "fast", choices=("fast", "slow"))
    sizes: tuple[int, ...] | None = flag("--sizes", "N,N", None, parse=_sizes, const="1,1")
    inner: Inner = field(default_factory=Inner)
    hidden: int = 3          # no flag: not a setting


def parser() -> CommandParser:
    return add_job_flags(CommandParser(prog="job"), Job)


def parsed(argv: list[str]) -> Job:
    return build_job(Job, keyword_values(parser().parse_args(argv), Job), "job")


def test_flags_and_keywords_build_the_same_job() -> None:
    argv = ["--checkpoint", "c.pt", "--mode", "slow", "--sizes", "2,3", "--batch-size", "8", "--no-progress",
            "--tag", "a", "--tag", "b"]
    from_flags = parsed(argv)
    from_keywords = build_job(Job, {"checkpoint": "c.pt", "mode": "slow", "sizes": "2,3", "batch_size": 8,
                                "progress": False, "tags": ["a", "b"]}, "job")
    assert from_flags == from_keywords == Job("c.pt", "slow", (2, 3), Inner(8, False, ("a", "b")))
    assert build_job(Job, {"checkpoint": Path("c.pt")}, "job").checkpoint == "c.pt"      # a path read as its text


def test_defaults_come_from_the_fields() -> None:
    assert parsed(["--checkpoint", "x"]) == Job("x")
    assert parsed(["--checkpoint", "x", "--sizes"]).sizes == (1, 1)


def test_refusals_name_the_flag() -> None:
    with pytest.raises(ConfigError, match="--mode: 'medium': choose one of fast, slow"):
        build_job(Job, {"checkpoint": "c", "mode": "medium"}, "job")
    with pytest.raises(ConfigError, match="batch_sise: is not a setting of job; did you mean batch_size"):
        build_job(Job, {"checkpoint": "c", "batch_sise": 3}, "job")
    with pytest.raises(SystemExit):
        parsed(["--checkpoint", "c", "--sizes", "2,x"])
    with pytest.raises(ConfigError, match="--batch-size: must be a number >= 1, got 0"):
        build_job(Job, {"checkpoint": "c", "batch_size": 0}, "job")
    with pytest.raises(ConfigError, match="--rate: must be a number > 0 and <= 1, got 0"):
        parsed(["--checkpoint", "c", "--rate", "0"])
    with pytest.raises(ConfigError, match="--batch-size: 'x': not a whole number"):
        build_job(Job, {"checkpoint": "c", "batch_size": "x"}, "job")
    with pytest.raises(ConfigError, match="--checkpoint: is required: give checkpoint="):
        build_job(Job, {}, "job")


def test_only_the_flags_given_are_keywords_and_the_help_shows_defaults(capsys) -> None:
    assert keyword_values(parser().parse_args(["--checkpoint", "c", "--batch-size", "4"]), Job) == {
        "checkpoint": "c", "batch_size": 4}
    shown = " ".join(parser().format_help().split())
    assert "--batch-size BATCH_SIZE global batch (default: 32)" in shown and "(default: fast)" in shown
    assert "--no-progress no progress bar" in shown and "(default: True)" not in shown
    assert "--rate" not in shown                                        # hidden, yet accepted
    assert parsed(["--checkpoint", "c", "--rate", "1"]).inner.rate == 1.0
    with pytest.raises(SystemExit):
        parser().parse_args(["--checkpoint", "c", "--bach-size", "4"])
    said = capsys.readouterr().err
    assert said.count("\n") == 3 and "--bach-size: did you mean --batch-size" in said and "usage" not in said


def test_field_table() -> None:
    assert [f.path for f in flag_fields(Job)] == [("checkpoint",), ("mode",), ("sizes",), ("inner", "batch_size"),
                                                  ("inner", "progress"), ("inner", "tags"), ("inner", "rate")]
    assert set(flags_by_dest(Job)) == {"checkpoint", "mode", "sizes", "batch_size", "progress", "tags", "rate"}
