"""``--config FILE.toml`` on every command: the file's keys become the command's flags, placed before the command
line's words, so the command line wins (a flag it gives drops the file's: a repeated flag's list too); every key and
value is checked against the command's own flags first, naming the file's line."""
from __future__ import annotations

import difflib
import functools
from argparse import ArgumentTypeError
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NoReturn, Protocol, runtime_checkable

from ..config_file import CONFIG_OPTION, ConfigFile, Setting, read_config
from ..errors import ConfigError
from .commands import COMMANDS

SUGGESTIONS = 3
CLOSENESS = 0.6
ALWAYS = (CONFIG_OPTION, "--help")        # long options every command parser has besides its flags


class FlagKind(Enum):
    """How a flag takes its value, so how a file's value becomes its words."""

    SWITCH = "switch"                     # on when given: true gives it, false leaves it out
    REPEATED = "repeated"                 # each use adds one: a list gives it once per item
    OPTIONAL_VALUE = "optional value"     # a value, or alone (true) for the one it stands for
    VALUE = "value"                       # one value: a list is joined by commas


@dataclass(frozen=True)
class FileFlag:
    """A flag a file's key may name, as the parser was given it: one spelling (a former one too), the setting it
    gives (a former spelling's: its flag's), how it takes a value and its own check of one (the parser's type)."""

    option: str
    setting: str
    kind: FlagKind
    check: Callable[[str], object] | None = None


@runtime_checkable
class FlagsKept(Protocol):
    """A parser that keeps the flags a file may set (``CommandParser``: ``add_job_flags`` tells it each one)."""

    file_flags: list[FileFlag]


def key_name(text: str) -> str:
    """A key or flag as the file matches it: no leading dashes, ``_`` as ``-``, any case (``local_dp``: the flag
    ``--local-DP``)."""
    return text.removeprefix("--").replace("_", "-").lower()


def by_key(flags: Sequence[FileFlag]) -> dict[str, FileFlag]:
    """The long flags by ``key_name``."""
    return {key_name(flag.option): flag for flag in flags if flag.option.startswith("--")}


def named_option(word: str, options: Sequence[str]) -> str | None:
    """The option a command-line word names, as argparse reads it (a long flag may be cut short while it stays
    unique; ``--lr=0.1``); None for a value."""
    if not word.startswith("-") or word in ("-", "--"):
        return None
    name = word.split("=", 1)[0]
    if name in options:
        return name
    matches = [option for option in options if name.startswith("--") and option.startswith(name)]
    return matches[0] if len(matches) == 1 else None


def split_config(argv: Sequence[str], options: Sequence[str]) -> tuple[str | None, list[str]]:
    """The file ``--config`` names (None: not given) and the other words; ConfigError when it is given twice or
    without a file."""
    path: str | None = None
    rest: list[str] = []
    words = list(argv)
    index = 0
    while index < len(words):
        word = words[index]
        if word == "--":
            rest += words[index:]
            break
        if named_option(word, options) != CONFIG_OPTION:
            rest.append(word)
            index += 1
            continue
        if path is not None:
            raise ConfigError(CONFIG_OPTION, "given twice; give one file (put the settings of both in it)")
        if "=" in word:
            path = word.split("=", 1)[1]
            index += 1
        elif index + 1 < len(words) and not words[index + 1].startswith("-"):
            path = words[index + 1]
            index += 2
        else:
            raise ConfigError(CONFIG_OPTION, "needs a file: --config FILE.toml")
    return path, rest


def settings_given(argv: Sequence[str], flags: Sequence[FileFlag]) -> set[str]:
    """The settings the command line gives itself (a former spelling's: its flag's)."""
    spelled = {flag.option: flag.setting for flag in flags}
    options = [*spelled, *ALWAYS]
    given: set[str] = set()
    for word in argv:
        if word == "--":
            break
        option = named_option(word, options)
        if option in spelled:
            given.add(spelled[option])
    return given


def refuse_setting(file: ConfigFile, setting: Setting, message: str) -> NoReturn:
    raise ConfigError(CONFIG_OPTION, f"{file.where(setting.line)}: {setting.key}: {message}")


def closest_hint(name: str, names: Sequence[str]) -> str:
    """"; did you mean X?" for the names closest_hint to ``name`` (empty when none is close)."""
    close = difflib.get_close_matches(key_name(name), list(names), n=SUGGESTIONS, cutoff=CLOSENESS)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def setting_text(file: ConfigFile, setting: Setting, flag: FileFlag, value: object) -> str:
    """One value of a setting as the flag's text: a string as it is, a number as Python writes it."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value) if isinstance(value, float) else str(value)
    refuse_setting(file, setting, f"{flag.option} takes text or a number (or a list of them), not "
                          f"{type(value).__name__} {value!r}")


def checked(file: ConfigFile, setting: Setting, flag: FileFlag, text: str) -> str:
    """``text`` when the flag takes it (its own check: type and choices), else the flag's refusal with the line."""
    if flag.check is not None:
        try:
            flag.check(text)
        except (ArgumentTypeError, TypeError, ValueError) as err:
            refuse_setting(file, setting, f"{flag.option} {err}")
    return text


def setting_words(file: ConfigFile, setting: Setting, flag: FileFlag) -> list[str]:
    """The command-line words of one setting: a switch given for true, nothing for false; a repeated flag once per
    item of a list; a list for any other flag joined by commas (``classes = ["a", "b"]``: ``--classes=a,b``); each
    value checked by the flag."""
    value, option = setting.value, flag.option
    if isinstance(value, dict):
        refuse_setting(file, setting, "a table is no flag's value: give text, a number, true/false or a list")
    if flag.kind is FlagKind.SWITCH:
        if not isinstance(value, bool):
            refuse_setting(file, setting, f"{option} is a switch: true (give it) or false (leave it out), "
                                          f"not {value!r}")
        return [option] if value else []
    if isinstance(value, bool):
        if flag.kind is FlagKind.OPTIONAL_VALUE:
            return [option] if value else []
        refuse_setting(file, setting, f"{option} takes a value, not {str(value).lower()}")
    items = value if isinstance(value, list) else [value]
    texts = [setting_text(file, setting, flag, item) for item in items]
    if flag.kind is FlagKind.REPEATED:
        return [f"{option}={checked(file, setting, flag, text)}" for text in texts]
    return [f"{option}={checked(file, setting, flag, ','.join(texts))}"]


@functools.cache
def command_keys(name: str) -> frozenset[str]:
    """The key names of the flags of the command ``name``."""
    command = next(c for c in COMMANDS if c.name == name)
    parser = command.parser()
    return frozenset(by_key(parser.file_flags)) if isinstance(parser, FlagsKept) else frozenset()


def commands_taking(key: str, command: str | None) -> list[str]:
    """The other commands that take the flag ``key`` names (a top-level key only they take is theirs)."""
    return [other.name for other in COMMANDS if other.name != command and key_name(key) in command_keys(other.name)]


def file_settings(file: ConfigFile, command: str | None, flags: Mapping[str, FileFlag],
                  given: Collection[str] = ()) -> list[tuple[Setting, FileFlag]]:
    """The settings of ``file`` that are ``command``'s flags: its top-level keys this command takes (a key no
    command takes refused) and every key of its own table (each must be its flag; they replace the top level's);
    a table that is no command's refused, and a key of another command's table that this command takes but gets
    neither from the file's top level, its own table nor the command line (``given``) refused (never dropped)."""
    commands = [c.name for c in COMMANDS]
    for table, line in file.tables.items():
        if table not in commands:
            hint = closest_hint(table, commands)
            raise ConfigError(CONFIG_OPTION, f"{file.where(line)}: [{table}] is no command's table (tables: "
                                             f"{', '.join(f'[{c}]' for c in commands)}){hint}")
    chosen: dict[str, tuple[Setting, FileFlag]] = {}
    for setting in file.shared():
        flag = flags.get(key_name(setting.key))
        if flag is None:
            if not commands_taking(setting.key, command):
                unknown_key(file, setting, command, flags)
            continue
        chosen[flag.setting] = (setting, flag)
    for setting in file.table(command) if command is not None else ():
        flag = flags.get(key_name(setting.key))
        if flag is None:
            unknown_key(file, setting, command, flags)
        chosen[flag.setting] = (setting, flag)
    for setting in file.settings:
        flag = flags.get(key_name(setting.key))
        if setting.table not in (None, command) and flag is not None and flag.setting not in {*chosen, *given}:
            misplaced_key(file, setting, command)
    return list(chosen.values())


def misplaced_key(file: ConfigFile, setting: Setting, command: str | None) -> NoReturn:
    """The refusal of a key in another command's table that ``command`` takes too and would otherwise drop."""
    refuse_setting(file, setting, f"is in [{setting.table}], a table {command} does not read, but {command} takes it "
                                  f"too: move it to the top level (every command's) or to [{command}], or set it for "
                                  f"{command} there as well")


def unknown_key(file: ConfigFile, setting: Setting, command: str | None, flags: Mapping[str, FileFlag]) -> NoReturn:
    """The refusal of a key that names no flag: the closest_hint flag of the command."""
    if key_name(setting.key) == key_name(CONFIG_OPTION):
        refuse_setting(file, setting, "a configuration file cannot name another; merge the two files")
    if setting.table is None:
        near = closest_hint(setting.key, [key_name(f.option) for f in flags.values()])
        refuse_setting(file, setting, f"is no command's flag (keys are long flag names without the dashes){near}")
    others = commands_taking(setting.key, command)
    if others:
        refuse_setting(file, setting, f"is not a flag of {command} but of {' and '.join(others)}: move it to the "
                                      f"top level or to [{others[0]}]")
    near = closest_hint(setting.key, [key_name(f.option) for f in flags.values()])
    refuse_setting(file, setting, f"is not a flag of {command} (keys are long flag names without the dashes){near}")


def with_config(argv: Sequence[str], command: str | None, flags: Sequence[FileFlag]) -> list[str]:
    """``argv`` without ``--config FILE`` and with the file's flags (those of ``flags``) before it, those the command
    line gives itself left out (unchanged without ``--config``); ConfigError naming the file's line for a key or
    value refused."""
    path, rest = split_config(argv, [*(flag.option for flag in flags), *ALWAYS])
    if path is None:
        return rest
    file = read_config(path)
    given = settings_given(rest, flags)
    words: list[str] = []
    for setting, flag in file_settings(file, command, by_key(flags), given):
        said = setting_words(file, setting, flag)         # checked even where the command line replaces it
        if flag.setting not in given:
            words += said
    return words + rest
