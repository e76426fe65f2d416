"""The argument parser every command uses: errors on rank 0 only, a usage error as its one line (with "did you mean"
for a misspelt flag and where the flags are listed), help that shows the defaults of flags that take a value (not of
on/off switches such as ``--no-progress``), and ``--config FILE.toml`` (``config_args.py``) for every command."""
from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from ..config_file import CONFIG_OPTION
from ..errors import ConfigError
from ..schema import world_rank_from_env
from .config_args import FileFlag, with_config

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

SUGGESTIONS = 3          # at most this many close flag names per misspelt one
CLOSENESS = 0.6          # difflib's similarity cut-off for a suggestion
LONG_FLAG = re.compile(r"--[A-Za-z0-9][\w-]*")
CONFIG_HELP = ("a TOML file of this command's flags: keys are the long flag names without the dashes (lr = 0.1, "
               "no-progress = true, classes = [\"a\", \"b\"]); top-level keys for every command that takes them, a "
               "[train], [evaluate], ... table for one; a flag on the command line replaces the file's "
               "(docs/batch-jobs.md)")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` after the help of flags that take a value and have a default; none after a switch
    (``--no-progress`` would say "(default: True)": the default of the setting, not of the flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or action.default is None or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser for commands every rank of a job parses alike: usage and errors print on rank 0 only,
    an error is one line (not the usage of every flag) and an unknown flag is answered with the closest known
    ones (pass ``formatter_class=DefaultsHelpFormatter`` to show defaults)."""

    def __init__(self, prog: str | None = None, description: str | None = None,
                 formatter_class: type[argparse.HelpFormatter] = argparse.HelpFormatter) -> None:
        self.hidden_flags: list[str] = []        # flags accepted but not shown (remember_flags)
        self.file_flags: list[FileFlag] = []     # the flags --config may set (remember_file_flag)
        self._given: list[str] = []
        super().__init__(prog=prog, description=description, formatter_class=formatter_class)
        self.add_argument(CONFIG_OPTION, metavar="FILE.toml", default=argparse.SUPPRESS, help=CONFIG_HELP)

    @property
    def command(self) -> str:
        """The command this parser reads (the last word of its ``prog``: ``python -m mpi4dl_nb train``)."""
        return self.prog.split()[-1] if self.prog else ""

    def remember_flags(self, *names: str) -> None:
        """Note flags the usage does not show (accepted, left out of the help) as known ones."""
        self.hidden_flags += [name for name in names if name.startswith("--")]

    def remember_file_flag(self, flag: FileFlag) -> None:
        """Note a flag (one spelling) a ``--config`` file may set."""
        self.file_flags.append(flag)

    def flag_names(self) -> list[str]:
        """Every long flag this parser knows: those its usage shows (however they were added: groups too), and the
        hidden ones remembered."""
        return sorted({*LONG_FLAG.findall(self.format_usage()), *self.hidden_flags})

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        if world_rank_from_env() in (None, 0):
            super()._print_message(message, file)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]  # argparse's overloads
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        """argparse's on the words given with ``--config``'s flags before them (a refused file: one line, exit 2),
        remembering the words given (``parse_args`` comes through here)."""
        self._given = list(sys.argv[1:] if args is None else args)     # what error() looks for misspellings in
        try:
            words = with_config(self._given, self.command, self.file_flags)
        except ConfigError as err:
            self.exit(2, f"{self.prog}: error: {err}\n")
        return super().parse_known_args(words, namespace)

    def unknown_flags(self) -> list[str]:
        """The flags given that this parser does not know (nor as an abbreviation)."""
        known = self.flag_names()
        given = [word.split("=", 1)[0] for word in self._given if word.startswith("--")]
        return [flag for flag in given if not any(name.startswith(flag) for name in known)]

    def suggest(self, flag: str) -> list[str]:
        """The known flags closest to a misspelt ``flag``, best first."""
        return difflib.get_close_matches(flag, self.flag_names(), n=SUGGESTIONS, cutoff=CLOSENESS)

    def error(self, message: str) -> NoReturn:
        """The error as one line (no usage of every flag before it), "did you mean" for each unknown flag given
        (also when the message is another one, e.g. a required flag missing because it was misspelt), and where
        the flags are listed; exit 2."""
        hints = [f"{flag}: did you mean {' or '.join(close)}?" for flag in self.unknown_flags()
                 if (close := self.suggest(flag))]
        lines = [f"{self.prog}: error: {message}", *hints, f"'{self.prog} --help' lists every flag."]
        self.exit(2, "\n".join(lines) + "\n")
