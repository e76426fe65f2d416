"""Jobs as their own schema: a dataclass field names its flag, help, parser and choices in one place
(``flag(...)``; an option several jobs take is one ``Option``, each job's field ``OPTION.field(default)``); the
command line and Python keywords are both read through these fields, a former spelling with a notice."""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import MISSING, Field, dataclass
from enum import Enum
from typing import TYPE_CHECKING, Literal, TypedDict, TypeVar

from .errors import ConfigError

T = TypeVar("T")
Parse = Callable[[str], object]
if TYPE_CHECKING:
    from typing import TypeAlias, Unpack

    Default: TypeAlias = T | Literal[dataclasses._MISSING_TYPE.MISSING]     # a value, or MISSING (a required field)
FLAG_KEY = "mpi4dl_nb.flag"     # the key of a field's metadata that holds its Flag
TAGS_KEY = "mpi4dl_nb.tags"     # the key of a field's metadata that holds its tags (a job's own kinds of flag)
SUGGESTIONS = 3                 # close names offered for a misspelt keyword
# launcher variables holding this process's rank in the whole job, most specific first
WORLD_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK",
                        "PALS_RANKID", "SLURM_PROCID")


def whole_number(text: str) -> int:
    """A flag's text as an integer (ValueError saying what is expected)."""
    try:
        return int(text)
    except ValueError:
        raise ValueError("not a whole number") from None


def number(text: str) -> float:
    """A flag's text as a number (ValueError saying what is expected)."""
    try:
        return float(text)
    except ValueError:
        raise ValueError("not a number") from None


@dataclass(frozen=True)
class Bounds:
    """The range of a number flag: at least ``least`` (above it when not ``closed``), at most ``most``."""

    least: float
    most: float | None = None
    closed: bool = True

    def check(self, option: str, value: object) -> None:
        """ConfigError naming ``option`` for a number outside the range or not finite (None and non-numbers pass:
        a volume's ``D,H,W`` is checked side by side as it is parsed)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        low = value >= self.least if self.closed else value > self.least
        if not math.isfinite(value) or not low or (self.most is not None and value > self.most):
            bound = f"{'>=' if self.closed else '>'} {self.least:g}" + (
                f" and <= {self.most:g}" if self.most is not None else "")
            raise ConfigError(option, f"must be a number {bound}, got {value:g}")


class FlagSettings(TypedDict, total=False):
    """A Flag's settings after its option and help (see Flag), as ``flag`` and ``option`` take them."""

    parse: Parse | None
    choices: tuple[str, ...]
    metavar: str | None
    group: str
    aliases: tuple[str, ...]
    switch: bool
    repeat: bool
    const: str | None
    dest: str
    bounds: Bounds | None
    hidden: bool
    old: tuple[str, ...]
    default_text: str | None


@dataclass(frozen=True)
class Flag:
    """How one job field is given on the command line: the flag, its help, how text becomes the value."""

    option: str
    help: str
    parse: Parse | None = None      # the flag's text as the field's value (ValueError or ConfigError saying why not)
    choices: tuple[str, ...] = ()   # the texts accepted (checked before ``parse``)
    metavar: str | None = None
    group: str = "options"
    aliases: tuple[str, ...] = ()
    switch: bool = False            # an on/off flag: given, it sets the opposite of the default
    repeat: bool = False            # every use collected into a tuple
    const: str | None = None        # what the flag given without a value means (``--checkpoint-activations``: every)
    dest: str = ""                  # the keyword of ``dl.<command>(...)`` (default: the flag less dashes, --no-, case)
    bounds: Bounds | None = None    # the range of a number (``check_bounds``)
    hidden: bool = False            # accepted but left out of the help (kept for command lines of other commands)
    old: tuple[str, ...] = ()       # former spellings, accepted with a notice naming ``option`` (their keywords too)
    default_text: str | None = None     # what a default of None stands for, as the help says (``the checkpoint's``)

    def __post_init__(self) -> None:
        if not self.option.startswith("--"):
            raise ValueError(f"flag {self.option!r}: long options only (--name)")
        if not self.dest:
            object.__setattr__(self, "dest", keyword_of(self.option, self.switch))

    @property
    def old_keywords(self) -> dict[str, str]:
        """The keywords of the former spellings, each with its spelling (``{"resume": "--resume"}``)."""
        return {keyword_of(old, self.switch): old for old in self.old}

    @property
    def meaning(self) -> Flag:
        """The flag less where a job lists it (its group, whether the help hides it): what an option means, the
        same in every job that takes it."""
        return dataclasses.replace(self, group="", hidden=False, default_text=None)

    def value_of(self, text: str) -> object:
        """``text`` as the field's value: checked against the choices, then parsed; ConfigError naming the flag."""
        if self.choices and text not in self.choices:
            raise ConfigError(self.option, f"{text!r}: choose one of {', '.join(self.choices)}")
        if self.parse is None:
            return text
        try:
            return self.parse(text)
        except ConfigError:
            raise
        except (ValueError, TypeError) as err:
            raise ConfigError(self.option, f"{text!r}: {err}") from None


def keyword_of(option: str, switch: bool = False) -> str:
    """The keyword of a flag: its name without dashes (a switch's without ``no-``), ``_`` for ``-``, lower case."""
    name = option[2:].removeprefix("no-") if switch else option[2:]
    return name.replace("-", "_").lower()


def renamed_notice(old: str, new: str) -> str:
    """The one line that says a former spelling was used and names the new one."""
    return f"note: {old} is now {new}; {old} still works for now"


def world_rank_from_env() -> int | None:
    """This process's rank from the launcher's environment (None: not launched by one), without MPI."""
    for name in WORLD_RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def tell_renamed(old: str, new: str) -> None:
    """Print ``renamed_notice`` on stderr (rank 0 of a job only: every rank reads the same flags)."""
    if world_rank_from_env() in (None, 0):
        print(renamed_notice(old, new), file=sys.stderr)


def _field(given: Flag, default: Default[T], default_factory: Callable[[], T] | None, tags: Iterable[Enum]) -> T:
    meta: dict[str, object] = {FLAG_KEY: given, TAGS_KEY: frozenset(tags)}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    if default is MISSING:
        return dataclasses.field(metadata=meta)     # a required field: its type is the one the job declares
    return dataclasses.field(default=default, metadata=meta)


def flag(option: str, help: str, default: Default[T] = MISSING, *, default_factory: Callable[[], T] | None = None,
         tags: Iterable[Enum] = (), **how: Unpack[FlagSettings]) -> T:
    """A dataclass field given by ``option`` on the command line (``how``: the other Flag settings; ``tags``: the
    job's own kinds this flag belongs to, ``tagged``)."""
    return _field(Flag(option, help, **how), default, default_factory, tags)


def nested(default_factory: Callable[[], T], *, tags: Iterable[Enum] = ()) -> T:
    """A field holding a dataclass of flags, its flags given ``tags`` (see ``flag``)."""
    return dataclasses.field(default_factory=default_factory, metadata={TAGS_KEY: frozenset(tags)})


@dataclass(frozen=True)
class Option:
    """An option several jobs take, declared once: its Flag (type, parser, bounds, choices, switch-ness, help).
    Each job makes its field with ``OPTION.field(default)``: its own default, and where its help lists the flag."""

    flag: Flag

    def field(self, default: Default[T] = MISSING, *, default_factory: Callable[[], T] | None = None,
              default_text: str | None = None, group: str | None = None, hidden: bool = False,
              tags: Iterable[Enum] = ()) -> T:
        """A job's field of this option: ``default`` its own (``default_text``: what None stands for, in the help);
        ``group`` (default the option's) and ``hidden`` where the job's help lists it; ``tags`` the job's own kinds
        of flag (``tagged``)."""
        given = dataclasses.replace(self.flag, group=self.flag.group if group is None else group, hidden=hidden,
                                    default_text=default_text)
        return _field(given, default, default_factory, tags)


def option(name: str, help: str, **how: Unpack[FlagSettings]) -> Option:
    """An Option of the flag ``name`` (``how``: the other Flag settings)."""
    return Option(Flag(name, help, **how))


@dataclass(frozen=True)
class FlagField:
    """A flag-bearing field of a job: where it sits (field names from the job down) and its flag."""

    path: tuple[str, ...]
    field: Field[object]
    flag: Flag
    tags: frozenset[Enum] = frozenset()

    @property
    def default(self) -> object:
        """The field's default (a fresh one from its factory), MISSING for a field that has none."""
        if self.field.default is not MISSING:
            return self.field.default
        if self.field.default_factory is not MISSING:
            return self.field.default_factory()
        return MISSING


def _nested(cls: type, f: Field[object]) -> type | None:
    """The dataclass a field without a flag holds (its fields are read in turn), None for a plain field."""
    hint = typing.get_type_hints(cls).get(f.name)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def flag_fields(job: type, path: tuple[str, ...] = (), tags: frozenset[Enum] = frozenset()) -> Iterator[FlagField]:
    """Every flag of ``job`` and of the dataclasses its fields hold, in field order (depth first); each one's tags
    its own and those of the fields holding it."""
    for f in dataclasses.fields(job):
        given = f.metadata.get(FLAG_KEY)
        own = tags | f.metadata.get(TAGS_KEY, frozenset())
        if isinstance(given, Flag):
            yield FlagField((*path, f.name), f, given, own)
        elif (inner := _nested(job, f)) is not None:
            yield from flag_fields(inner, (*path, f.name), own)


def tagged(job: type, tag: Enum) -> list[FlagField]:
    """The flags of ``job`` tagged ``tag`` (``flag(..., tags=...)``, or a nested field's ``nested(tags=...)``)."""
    return [item for item in flag_fields(job) if tag in item.tags]


def flags_by_dest(job: type) -> dict[str, FlagField]:
    """``job``'s flags by keyword name; ValueError when two fields claim one name."""
    found: dict[str, FlagField] = {}
    for item in flag_fields(job):
        if item.flag.dest in found:
            raise ValueError(f"{job.__name__}: {item.flag.option} and {found[item.flag.dest].flag.option} share "
                             f"the keyword {item.flag.dest!r}")
        found[item.flag.dest] = item
    return found


def unknown_keyword(name: str, known: Mapping[str, object], command: str) -> ConfigError:
    """The error for a keyword no flag of ``command`` has, with the closest names."""
    close = difflib.get_close_matches(name, list(known), n=SUGGESTIONS)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return ConfigError(name, f"is not a setting of {command}{hint}")


def check_bounds(spec: object) -> None:
    """ConfigError naming the flag of the first of ``spec``'s own number fields outside its ``bounds``."""
    for f in dataclasses.fields(spec):        # type: ignore[arg-type]  # spec is a dataclass instance
        given = f.metadata.get(FLAG_KEY)
        if isinstance(given, Flag) and given.bounds is not None:
            given.bounds.check(given.option, getattr(spec, f.name))


def typed_value(item: FlagField, value: object) -> object:
    """A keyword's value as the field holds it: text (a path's too) parsed as the flag parses it (each item of a
    repeated flag's list), anything else as given."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        parsed = item.flag.value_of(value)
        return (parsed,) if item.flag.repeat else parsed
    if item.flag.repeat and isinstance(value, (list, tuple)):
        return tuple(item.flag.value_of(v) if isinstance(v, str) else v for v in value)
    return value


def current_keywords(values: Mapping[str, object], known: Mapping[str, FlagField]) -> dict[str, object]:
    """``values`` with a former flag's keyword as its flag's (a notice on stderr naming the new one); a keyword given
    in both spellings keeps the new one's value."""
    old = {name: item.flag for item in known.values() for name in item.flag.old_keywords}
    current: dict[str, object] = {}
    for name, value in values.items():
        if name in old and name not in known:
            tell_renamed(f"{name}=", f"{old[name].dest}=")
            current.setdefault(old[name].dest, value)
        else:
            current[name] = value
    return current


def build_job(job: type[T], values: Mapping[str, object], command: str, path: tuple[str, ...] = ()) -> T:
    """``job`` from values keyed by keyword name (``batch_size=8``): the flag fields they name set, the rest
    default; nested dataclasses built alike. ConfigError for a keyword no field has (with the closest)."""
    known = flags_by_dest(job) if not path else {}
    if not path:
        values = current_keywords(values, known)
        for name in values:
            if name not in known:
                raise unknown_keyword(name, known, command)
    kwargs: dict[str, object] = {}
    for f in dataclasses.fields(job):          # type: ignore[arg-type]  # job is a dataclass type
        given = f.metadata.get(FLAG_KEY)
        if isinstance(given, Flag):
            if given.dest in values:
                kwargs[f.name] = typed_value(FlagField((*path, f.name), f, given), values[given.dest])
            elif f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(given.option, f"is required: give {given.dest}=... ({given.option} on the command "
                                                f"line)")
        elif (inner := _nested(job, f)) is not None:
            kwargs[f.name] = build_job(inner, values, command, (*path, f.name))
    return job(**kwargs)
