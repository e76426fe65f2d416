"""A command's flags generated from its job's fields (``schema.flag``), and the parsed flags as keyword values."""
from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import MISSING
from enum import Enum
from typing import TypeVar

from ..errors import ConfigError
from ..schema import Flag, FlagField, build_job, flag_fields, tell_renamed
from .config_args import FileFlag, FlagKind
from .parser import CommandParser, DefaultsHelpFormatter

J = TypeVar("J")
AddFlag = Callable[..., argparse.Action]      # a parser's or an argument group's ``add_argument``


def _typed(item: FlagField) -> Callable[[str], object]:
    """argparse's ``type`` for a flag: its checks and parser, a refusal printed as a usage error of the flag."""
    def convert(text: str) -> object:
        try:
            return item.flag.value_of(text)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(err.detail) from None
    convert.__name__ = item.flag.option      # argparse names the type in some of its own messages
    return convert


def shown_default(value: object) -> str | None:
    """A default as the help shows it (None: a value without a short text, or no default)."""
    if value is None or value is MISSING or isinstance(value, bool):
        return None
    if isinstance(value, Enum):
        return str(value.value)
    return str(value) if isinstance(value, (str, int, float)) else None


def help_text(item: FlagField) -> str:
    """The flag's help with its default (not a switch's: it would be the setting's, not the flag's), ``%`` kept as
    written (argparse formats help with ``%``)."""
    if item.flag.hidden:
        return argparse.SUPPRESS
    default = None if item.flag.switch else shown_default(item.default)
    if default is None and item.default is None:
        default = item.flag.default_text
    text = item.flag.help + ("" if default is None else f" (default: {default})")
    return text.replace("%", "%%")


def argparse_options(item: FlagField) -> dict[str, object]:
    """The ``add_argument`` options of a flag. A flag not given stays out of the parsed values (its field keeps
    its default), so flags and keywords build a job from the same defaults."""
    flag = item.flag
    options: dict[str, object] = {"dest": flag.dest, "default": argparse.SUPPRESS, "help": help_text(item)}
    if flag.switch:
        options["action"] = "store_false" if item.default is True else "store_true"
        return options
    options["type"] = _typed(item)
    if item.default is MISSING:
        options["required"] = True
    if flag.repeat:
        options["action"] = "append"
    if flag.const is not None:
        options.update(nargs="?", const=flag.const)
    metavar = flag.metavar or ("{" + ",".join(flag.choices) + "}" if flag.choices else None)
    if metavar is not None:
        options["metavar"] = metavar
    return options


def old_spelling_options(item: FlagField, old: str) -> dict[str, object]:
    """The ``add_argument`` options of a flag's former spelling ``old``: parsed as the flag, kept under ``old`` (not
    the flag's keyword: ``keyword_values`` tells it is renamed), hidden from the help."""
    options = argparse_options(item)
    options.update(dest=old, help=argparse.SUPPRESS)
    options.pop("required", None)
    return options


def add_job_flags(parser: CommandParser, job: type) -> CommandParser:
    """Add a flag for every flag field of ``job`` (its nested dataclasses' too), in groups, and its former spellings
    (accepted with a notice, not shown); returns ``parser``."""
    groups: dict[str, AddFlag] = {}
    hidden: AddFlag = parser.add_argument     # the former spellings: on the parser, out of the help
    for item in flag_fields(job):
        flag = item.flag
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group).add_argument
        if flag.hidden:
            parser.remember_flags(flag.option, *flag.aliases)
        groups[flag.group](flag.option, *flag.aliases, **argparse_options(item))
        for old in flag.old:
            parser.remember_flags(old)
            hidden(old, **old_spelling_options(item, old))
        for spelling in (flag.option, *flag.aliases, *flag.old):
            parser.remember_file_flag(FileFlag(spelling, flag.dest, flag_kind(flag),
                                               None if flag.switch else _typed(item)))
    return parser


def flag_kind(flag: Flag) -> FlagKind:
    """How ``flag`` takes its value (how a ``--config`` file's value becomes its words)."""
    if flag.switch:
        return FlagKind.SWITCH
    if flag.repeat:
        return FlagKind.REPEATED
    return FlagKind.VALUE if flag.const is None else FlagKind.OPTIONAL_VALUE


def keyword_values(args: argparse.Namespace, job: type) -> dict[str, object]:
    """The flags of ``job`` given on the command line as the keyword values ``schema.build_job`` takes (a flag not
    given is left out: its field keeps its default; a former spelling gives the flag's value, with a notice naming
    the flag, unless the flag itself is given)."""
    given: Mapping[str, object] = vars(args)
    values: dict[str, object] = {}
    for item in flag_fields(job):
        for name in (item.flag.dest, *item.flag.old):     # the flag, then its former spellings (a notice each)
            if name not in given:
                continue
            if name != item.flag.dest:
                tell_renamed(name, item.flag.option)
            value = given[name]
            if item.flag.dest not in values:
                values[item.flag.dest] = tuple(value) if item.flag.repeat and isinstance(value, list) else value
    return values


def job_parser(prog: str, description: str, job: type) -> CommandParser:
    """A command's parser: a flag for every flag field of ``job``, defaults shown in the help."""
    return add_job_flags(CommandParser(prog=prog, description=description, formatter_class=DefaultsHelpFormatter),
                         job)


def parsed_job(args: argparse.Namespace, job: type[J], command: str) -> J:
    """The ``job`` the parsed flags name, built as ``dl.<command>(...)`` builds it from keywords."""
    return build_job(job, keyword_values(args, job), command)
