"""Progress lines on the rank that reports: ProgressLine (a bar redrawn on a terminal, one line per update
elsewhere) and PacedLine (outside a terminal, one line every few seconds), with their time text."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

LINE_EVERY_SECONDS = 5.0      # outside a terminal: at most one line per this many seconds (and the first and last)


def clock_text(seconds: float) -> str:
    """``0:07``, ``12:34``, ``1:02:03``: a duration as a clock shows it (whole seconds)."""
    minutes, secs = divmod(max(0, round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def rate_text(rate: float, unit: str, seconds_left: float) -> str:
    """``2.50 img/s ETA 0:12``: a rate in ``unit`` per second and the time left, as every progress line ends."""
    return f"{rate:.2f} {unit}/s ETA {clock_text(seconds_left)}"


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


class PacedLine:
    """A ProgressLine for long runs: on a terminal every update is drawn; elsewhere (a batch job's log) the first,
    the last, and then one every ``every`` seconds, the others held back (``finish`` writes the latest)."""

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None, *,
                 every: float = LINE_EVERY_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.line = ProgressLine(total, enabled, stream)
        self.every = every
        self.clock = clock
        self.started = clock()
        self.shown_at: float | None = None        # when the last line was written (outside a terminal)
        self.held: tuple[int, str] | None = None  # an update not written yet (outside a terminal)
        self.open = False                         # a terminal's bar drawn without its line's end

    @property
    def enabled(self) -> bool:
        return self.line.enabled

    def elapsed(self) -> float:
        """Seconds since the line was made."""
        return self.clock() - self.started

    def seconds_left(self, done: int, first: int = 0) -> float:
        """The time left after ``done`` of the total, at the pace so far of those after ``first`` (a resumed run's
        start); 0 before any."""
        ran = done - first
        return self.elapsed() / ran * (self.line.total - done) if ran > 0 else 0.0

    def update(self, done: int, text: str) -> None:
        """``done`` of the total with ``text``: written now on a terminal, or when due; else held back."""
        if not self.enabled:
            return
        now = self.clock()
        due = self.shown_at is None or now - self.shown_at >= self.every or done >= self.line.total
        if self.line.tty or due:
            self.line.update(done, text)
            self.shown_at, self.held, self.open = now, None, self.line.tty and done < self.line.total
        else:
            self.held = (done, text)

    def finish(self) -> None:
        """The run ends (early, too): the latest update held back is written, a terminal's bar line ended, so what
        follows (a message, the summary) starts a line of its own."""
        if self.held is not None:
            self.line.update(*self.held)
            self.held = None
        if self.open:
            self.line.stream.write("\n")
            self.line.stream.flush()
            self.open = False

    def note(self, text: str) -> None:
        """A line of its own, not overwritten by the bar."""
        self.line.note(text)
        self.open = False          # a terminal's bar line was ended before the note
