"""A command's flags generated from its job's fields (``schema.flag``), and the parsed flags as keyword values."""
from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import MISSING
from typing import Any, Protocol

from ..errors import ConfigError
from ..schema import FlagField, flag_fields


class FlagAdder(Protocol):
    """What a parser or an argument group offers: adding a flag."""

    def add_argument(self, *name_or_flags: str, **kwargs: Any) -> argparse.Action: ...


def _typed(item: FlagField) -> Callable[[str], object]:
    """argparse's ``type`` for a flag: its checks and parser, a refusal printed as a usage error of the flag."""
    def convert(text: str) -> object:
        try:
            return item.flag.value_of(text)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(err.detail) from None
    convert.__name__ = item.flag.option      # argparse names the type in some of its own messages
    return convert


def add_job_flags(parser: argparse.ArgumentParser, job: type) -> argparse.ArgumentParser:
    """Add a flag for every flag field of ``job`` (its nested dataclasses' too), in groups; returns ``parser``."""
    groups: dict[str, FlagAdder] = {}
    for item in flag_fields(job):
        flag = item.flag
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group)
        group = groups[flag.group]
        names = (flag.option, *flag.aliases)
        default = item.default
        if flag.switch:
            action = "store_false" if default is True else "store_true"
            group.add_argument(*names, dest=flag.dest, action=action, default=default, help=flag.help)
            continue
        options: dict[str, object] = {"dest": flag.dest, "type": _typed(item), "help": flag.help}
        if default is MISSING:
            options["required"] = True
        else:
            options["default"] = None if flag.repeat else default
        if flag.repeat:
            options["action"] = "append"
        if flag.const is not None:
            options.update(nargs="?", const=flag.const)
        metavar = flag.metavar or ("{" + ",".join(flag.choices) + "}" if flag.choices else None)
        if metavar is not None:
            options["metavar"] = metavar
        group.add_argument(*names, **options)
    return parser


def keyword_values(args: argparse.Namespace, job: type) -> dict[str, object]:
    """The parsed flags of ``job`` as the keyword values ``schema.build_job`` takes (a repeated flag not given
    left out, so its field keeps its default)."""
    given: Mapping[str, object] = vars(args)
    values: dict[str, object] = {}
    for item in flag_fields(job):
        value = given.get(item.flag.dest)
        if item.flag.repeat:
            if value is None:
                continue
            value = tuple(value) if isinstance(value, list) else value      # argparse's append list
        values[item.flag.dest] = value
    return values
