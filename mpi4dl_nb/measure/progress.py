"""ProgressLine: a one-line bar redrawn on a terminal, one line per update elsewhere (the rank that reports)."""

from __future__ import annotations

import sys
from typing import TextIO


class ProgressLine:
    """``[#####.....] <text>`` on stderr: redrawn in place on a terminal, a new line per update otherwise
    (logs of batch jobs); ``enabled=False`` (every rank but the reporting one) prints nothing."""

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None, width: int = 30) -> None:
        self.total = max(1, total)
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def bar(self, done: int) -> str:
        """The bar alone for ``done`` of ``total``."""
        filled = min(self.width, int(self.width * done / self.total))
        return f"[{'#' * filled}{'.' * (self.width - filled)}]"

    def update(self, done: int, text: str) -> None:
        """Show ``done`` of ``total`` with ``text`` after the bar (the last update ends the line on a terminal)."""
        if not self.enabled:
            return
        line = f"{self.bar(done)} {text}"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done >= self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """A line of its own (an evaluation's figures, a warning), not overwritten by the bar."""
        if self.enabled:
            self.stream.write(("\n" if self.tty else "") + text + "\n")
            self.stream.flush()
