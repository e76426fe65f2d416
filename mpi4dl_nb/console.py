"""Messages on stderr, each in one write, and the commands' set-up lines: under ``mpiexec`` stdout and stderr travel
apart, so a block written in pieces (``print`` writes its text, then its newline) lets a JSON line from stdout land
inside it."""

from __future__ import annotations

import sys


def to_stderr(text: str) -> None:
    """Write ``text`` and its newline to stderr at once, flushed."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class SetupLines:
    """What a command's set-up is doing, a line as each part starts (``mpi4dl_nb train: setting up: reading the data
    in slides/ ...``), so a long set-up is never silent; ``enabled=False`` (ranks but 0, ``--no-progress``) says
    nothing. Lines of its own on stderr, like the progress lines that follow."""

    def __init__(self, command: str, enabled: bool) -> None:
        self.command = command
        self.enabled = enabled

    def doing(self, text: str) -> None:
        """Say that set-up now does ``text``."""
        if self.enabled:
            to_stderr(f"mpi4dl_nb {self.command}: setting up: {text} ...")

    def note(self, text: str) -> None:
        """A line about the set-up's outcome (a choice it made), under the same condition."""
        if self.enabled:
            to_stderr(f"mpi4dl_nb {self.command}: {text}")
