"""schema.py and cli/job_flags.py: one field table gives the parser and the keyword builder, and both build the
same job."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from pathlib import Path

import pytest

from mpi4dl_nb.cli.job_flags import add_job_flags, keyword_values
from mpi4dl_nb.cli.parser import CommandParser
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.schema import (
    Bounds,
    Flag,
    FlagSettings,
    build_job,
    check_bounds,
    flag,
    flag_fields,
    flags_by_dest,
    nested,
    number,
    option,
    renamed_notice,
    tagged,
    whole_number,
)


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


# ----------------------------------------------------------------- one option, many jobs; former spellings; tags
class Kind(Enum):
    LOUD = "loud"


SEED = option("--seed", "the seed", parse=whole_number, bounds=Bounds(0), group="run")


@dataclass(frozen=True)
class Quiet:
    level: int = flag("--level", "how loud", 1, parse=whole_number, tags=(Kind.LOUD,))


@dataclass(frozen=True)
class First:
    seed: int = SEED.field(0)
    save: str | None = flag("--save-json", "write here", None, old=("--json",))
    quiet: Quiet = nested(Quiet)


@dataclass(frozen=True)
class Second:
    seed: int | None = SEED.field(None, default_text="the record's", group="other", hidden=True)
    loud: Quiet = nested(Quiet, tags=(Kind.LOUD,))
    on: bool = flag("--on", "a switch", False, switch=True, old=("--enable",))


def test_an_option_is_one_meaning_with_each_jobs_default():
    first, second = flags_by_dest(First)["seed"], flags_by_dest(Second)["seed"]
    assert (first.default, second.default) == (0, None)
    assert first.flag.meaning == second.flag.meaning == SEED.flag.meaning
    assert (first.flag.group, second.flag.group, second.flag.hidden) == ("run", "other", True)
    assert second.flag.default_text == "the record's" and first.flag.default_text is None


def test_tags_come_from_the_flag_and_the_fields_holding_it():
    assert [item.path for item in tagged(First, Kind.LOUD)] == [("quiet", "level")]
    assert [item.path for item in tagged(Second, Kind.LOUD)] == [("loud", "level")]


def test_a_former_keyword_builds_the_flag_with_a_notice(capsys):
    assert build_job(First, {"json": "a.json"}, "first").save == "a.json"
    assert capsys.readouterr().err == renamed_notice("json=", "save_json=") + "\n"
    assert build_job(First, {"json": "a.json", "save_json": "b.json"}, "first").save == "b.json"
    with pytest.raises(ConfigError, match="is not a setting of first"):
        build_job(First, {"jsn": "a.json"}, "first")


RENAMED = renamed_notice("--json", "--save-json")


@pytest.mark.parametrize("argv, value, notice", [
    (["--save-json", "b.json"], "b.json", ""), (["--json", "a.json"], "a.json", RENAMED),
    (["--json", "a.json", "--save-json", "b.json"], "b.json", RENAMED)])      # the new spelling's value wins
def test_a_former_spelling_on_the_command_line_gives_the_flag_with_a_notice(capsys, argv, value, notice):
    parsed = add_job_flags(CommandParser(prog="first"), First).parse_args(argv)
    assert build_job(First, keyword_values(parsed, First), "first").save == value
    assert capsys.readouterr().err.strip() == notice
    assert "--json" not in add_job_flags(CommandParser(prog="first"), First).format_help()


def test_a_former_switch_spelling_sets_the_switch(capsys):
    parsed = add_job_flags(CommandParser(prog="second"), Second).parse_args(["--enable"])
    assert build_job(Second, keyword_values(parsed, Second), "second").on is True
    assert capsys.readouterr().err.strip() == renamed_notice("--enable", "--on")


def test_a_notice_prints_on_rank_0_only(capsys, monkeypatch):
    monkeypatch.setenv("PMI_RANK", "1")
    assert build_job(Second, {"enable": True}, "second").on is True
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("PMI_RANK", "0")
    build_job(Second, {"enable": True}, "second")
    assert capsys.readouterr().err.strip() == renamed_notice("enable=", "on=")


def test_flag_settings_are_the_flag_fields_after_option_and_help() -> None:
    """``flag(option, help, **settings)`` is typed by FlagSettings: it names every Flag field but the first two."""
    assert list(FlagSettings.__annotations__) == [f.name for f in fields(Flag)][2:]


def test_a_required_flag_has_no_default_and_a_given_one_keeps_its_own() -> None:
    required = {item.flag.option: item.field for item in flag_fields(Job)}
    assert required["--checkpoint"].default is MISSING and required["--checkpoint"].default_factory is MISSING
    assert required["--sizes"].default is None and required["--tag"].default == ()
