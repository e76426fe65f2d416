"""schema.py and cli/job_flags.py: one field table gives the parser and the keyword builder, and both build the
same job."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from mpi4dl_nb.cli.job_flags import add_job_flags, keyword_values
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.schema import build_job, flag, flag_fields, flags_by_dest


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(","))


@dataclass(frozen=True)
class Inner:
    batch_size: int = flag("--batch-size", "global batch", 32, parse=int, group="data")
    progress: bool = flag("--no-progress", "no progress bar", True, switch=True)
    tags: tuple[str, ...] = flag("--tag", "repeatable", (), repeat=True, dest="tags")


@dataclass(frozen=True)
class Job:
    checkpoint: str = flag("--checkpoint", "the file")
    mode: str = flag("--mode", "how", "fast", choices=("fast", "slow"))
    sizes: tuple[int, ...] | None = flag("--sizes", "N,N", None, parse=_sizes, const="1,1")
    inner: Inner = field(default_factory=Inner)
    hidden: int = 3          # no flag: not a setting


def parsed(argv: list[str]) -> Job:
    parser = add_job_flags(argparse.ArgumentParser(), Job)
    return build_job(Job, keyword_values(parser.parse_args(argv), Job), "job")


def test_flags_and_keywords_build_the_same_job() -> None:
    argv = ["--checkpoint", "c.pt", "--mode", "slow", "--sizes", "2,3", "--batch-size", "8", "--no-progress",
            "--tag", "a", "--tag", "b"]
    from_flags = parsed(argv)
    from_keywords = build_job(Job, {"checkpoint": "c.pt", "mode": "slow", "sizes": "2,3", "batch_size": 8,
                                "progress": False, "tags": ["a", "b"]}, "job")
    assert from_flags == from_keywords == Job("c.pt", "slow", (2, 3), Inner(8, False, ("a", "b")))


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


def test_field_table() -> None:
    assert [f.path for f in flag_fields(Job)] == [("checkpoint",), ("mode",), ("sizes",), ("inner", "batch_size"),
                                                  ("inner", "progress"), ("inner", "tags")]
    assert set(flags_by_dest(Job)) == {"checkpoint", "mode", "sizes", "batch_size", "progress", "tags"}
