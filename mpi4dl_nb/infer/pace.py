"""Inference's progress line on the rank that reports: the bar, what is done, the rate and the time left
(``windows 3/10 rows 1/2 1.25 MP/s ETA 0:12``), as training's line shows them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

from ..measure.progress import ProgressLine, rate_text


class PacedProgress:
    """A ProgressLine of ``total`` parts whose text ends with the rate (an amount per second of wall time since the
    line was made) and the time left (the wall time per part so far, after ``first`` parts done before, times the
    parts left); a line per update, as the bar of ``measure/progress.py`` writes it."""

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None, *, first: int = 0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.line = ProgressLine(total, enabled, stream)
        self.first = first
        self.clock = clock
        self.started = clock()

    @property
    def enabled(self) -> bool:
        return self.line.enabled

    def seconds_left(self, done: int, elapsed: float) -> float:
        """The time left after ``done`` parts at the pace so far; 0 before any."""
        ran = done - self.first
        return elapsed / ran * (self.line.total - done) if ran > 0 else 0.0

    def update(self, done: int, text: str, amount: float, unit: str) -> None:
        """``done`` parts with ``text``, then ``amount`` (in ``unit``, since the start) per second and the time left."""
        if not self.enabled:
            return
        elapsed = max(self.clock() - self.started, 1e-9)
        self.line.update(done, f"{text} {rate_text(amount / elapsed, unit, self.seconds_left(done, elapsed))}")

    def note(self, text: str) -> None:
        """A line of its own, not overwritten by the bar."""
        self.line.note(text)


def slides_text(done: int, total: int, seconds: float) -> str:
    """``3/5 slides, 12 s, 0.25 slides/s ETA 0:08``: a run of many slides after ``done`` of them in ``seconds``."""
    seconds = max(seconds, 1e-9)
    left = seconds / done * (total - done) if done > 0 else 0.0
    return f"{done}/{total} slides, {seconds:.0f} s, {rate_text(done / seconds, 'slides', left)}"
