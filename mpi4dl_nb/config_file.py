"""Configuration files (``--config FILE.toml``): a TOML file read with the line of each key, and a job's flags
written as the TOML that gives them back (every flag, defaults included: the ``config.toml`` of a training run)."""
from __future__ import annotations

import functools
import math
import re
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from .errors import ConfigError
from .schema import FlagField, flag_fields

CONFIG_OPTION = "--config"
# a key's line: a bare or quoted key before '=' (a dotted key: its first part); a table's header line
KEY_LINE = re.compile(r"""^\s*(?:"(?P<quoted>[^"]*)"|'(?P<literal>[^']*)'|(?P<bare>[A-Za-z0-9_-]+))\s*[=.]""")
TABLE_LINE = re.compile(r"""^\s*\[\s*(?:"(?P<quoted>[^"]*)"|'(?P<literal>[^']*)'|(?P<bare>[A-Za-z0-9_.-]+))\s*\]""")
COMMENT_WIDTH = 110                      # the width of a written file's comment lines
NONE_TEXTS = ("none", "")                 # what a flag whose value may be None might take for it
TEXT_METHODS = ("text", "describe")      # methods whose text a value's flag may parse back (``--augment``'s describe)


@dataclass(frozen=True)
class Setting:
    """One key of a configuration file: as written, its value as TOML read it, its line (0: not found), and the
    table it sits in (None: the top level, shared by every command)."""

    key: str
    value: object
    line: int
    table: str | None = None


@dataclass(frozen=True)
class ConfigFile:
    """A configuration file: its top-level settings and those of each table, with their lines."""

    path: Path
    settings: tuple[Setting, ...]
    tables: Mapping[str, int]             # table name -> the line of its header

    def where(self, line: int) -> str:
        """``FILE:LINE`` (``FILE`` alone for an unknown line)."""
        return f"{self.path}:{line}" if line else str(self.path)

    def shared(self) -> tuple[Setting, ...]:
        """The top-level settings (every command's)."""
        return tuple(s for s in self.settings if s.table is None)

    def table(self, name: str) -> tuple[Setting, ...]:
        """The settings of the table ``[name]``."""
        return tuple(s for s in self.settings if s.table == name)


def _name(match: re.Match[str]) -> str:
    return next(group for group in (match["quoted"], match["literal"], match["bare"]) if group is not None)


def key_lines(text: str) -> tuple[dict[tuple[str | None, str], int], dict[str, int]]:
    """The line of each (table, key) and of each table's header, as the file's lines show them (the first one: a
    line inside a multi-line string that looks like a key is not told apart)."""
    keys: dict[tuple[str | None, str], int] = {}
    tables: dict[str, int] = {}
    table: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        header = TABLE_LINE.match(line)
        if header is not None:
            table = _name(header).split(".")[0].strip()
            tables.setdefault(table, number)
            continue
        key = KEY_LINE.match(line)
        if key is not None:
            keys.setdefault((table, _name(key)), number)
    return keys, tables


def read_config(path: str | Path) -> ConfigFile:
    """The settings of the TOML file ``path``; ConfigError naming ``--config`` when it cannot be read or is not
    TOML."""
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(CONFIG_OPTION, f"{path}: no such file; give the path of a TOML file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(CONFIG_OPTION, f"{path}: cannot be read ({err}); give a readable UTF-8 TOML file") from None
    try:
        import tomllib
    except ModuleNotFoundError:          # Python 3.10
        raise ConfigError(CONFIG_OPTION, "reading TOML needs Python 3.11 or newer (tomllib); give the flags on the "
                                         "command line instead") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(CONFIG_OPTION, f"{path}: not TOML: {err}") from None
    lines, headers = key_lines(text)
    settings: list[Setting] = []
    for key, value in data.items():
        if isinstance(value, dict) and (None, key) not in lines:      # a table [key]
            settings += [Setting(inner, item, lines.get((key, inner), 0), key) for inner, item in value.items()]
            headers.setdefault(key, 0)
        else:
            settings.append(Setting(key, value, lines.get((None, key), 0)))
    return ConfigFile(file, tuple(settings), {name: headers[name] for name in data if name in headers})


# ---------------------------------------------------------------------------------------------------- writing
TomlValue = str | int | float | bool | list[str]


def toml_literal(value: TomlValue) -> str:
    """``value`` as TOML writes it: a basic string (JSON's escapes are TOML's), a number, true/false, an array."""
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else
                                                         ("inf" if value > 0 else "-inf"))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_literal(item) for item in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def flag_texts(value: object) -> Iterable[str]:
    """Texts a flag might take for ``value``, likeliest first: a choice's value, numbers and text as they are, the
    items of a tuple or set joined by commas, the value's own text method, its str (None: ``none``)."""
    if value is None:
        yield from NONE_TEXTS
    if isinstance(value, Enum):
        yield str(value.value)
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        yield str(value)
    if isinstance(value, (tuple, list, frozenset, set)):
        items = [next(iter(flag_texts(item)), "") for item in value]
        yield ",".join(sorted(items) if isinstance(value, (frozenset, set)) else items)
    for method in TEXT_METHODS:
        made = getattr(value, method, None)
        if callable(made):
            try:
                text = made()
            except TypeError:
                continue
            if isinstance(text, str):
                yield text
    yield str(value)


def parses_back(parse: Callable[[str], object], text: str, value: object) -> bool:
    """Whether the flag's parser turns ``text`` into ``value``."""
    try:
        return parse(text) == value
    except (ValueError, TypeError):      # ConfigError is a ValueError
        return False


def scalar_setting(item: FlagField, value: object) -> str | int | float | None:
    """The TOML value of one (non-switch) value of ``item``'s flag: a number as a number, else the first text that
    parses back to ``value``; None when none does."""
    parse = item.flag.value_of
    if isinstance(value, (int, float)) and not isinstance(value, (bool, Enum)) and parses_back(parse, str(value),
                                                                                              value):
        return value
    return next((text for text in flag_texts(value) if parses_back(parse, text, value)), None)


def flag_setting(item: FlagField, value: object) -> TomlValue | None:
    """The TOML value that gives ``value`` through ``item``'s flag (a switch: true when given, i.e. its value is not
    the default; a repeated flag: an array of its uses); None when no text parses back to ``value``."""
    if item.flag.switch:
        return bool(value != item.default)
    if item.flag.repeat and isinstance(value, (tuple, list)):
        items = [scalar_setting(item, part) for part in value]
        texts = [str(text) for text in items if text is not None]
        return texts if len(texts) == len(items) else None
    return scalar_setting(item, value)


def job_value(job: object, item: FlagField) -> object:
    """The value ``job`` holds for ``item``'s flag (down its nested dataclasses)."""
    return functools.reduce(getattr, item.path, job)


def job_toml(job: object, table: str, header: Sequence[str] = ()) -> str:
    """``job``'s every flag as a TOML table ``[table]`` (``--config`` gives the same job back): the flags by group,
    the unset ones (None where None is the default: the command's own) and any without a text its flag parses back
    listed in comments; ``header``: comment lines above."""
    groups: dict[str, list[str]] = {}
    unset: list[str] = []
    for item in flag_fields(type(job)):
        value = job_value(job, item)
        if value is None and item.default is None:
            unset.append(item.flag.option)
            continue
        setting = flag_setting(item, value)
        key = item.flag.option.removeprefix("--")
        groups.setdefault(item.flag.group, []).append(
            f"{key} = {toml_literal(setting)}" if setting is not None else
            f"# {key}: {value!r} has no text {item.flag.option} parses back; not written")
    lines = [f"# {text}" for text in header]
    lines += ["", f"[{table}]"]
    for group, settings in groups.items():
        lines += [f"# {group}", *settings]
    if unset:
        lines += textwrap.wrap(f"not set (the command's own default): {', '.join(unset)}", COMMENT_WIDTH,
                               initial_indent="# ", subsequent_indent="#   ", break_on_hyphens=False)
    return "\n".join(lines) + "\n"
