"""Training's progress line on rank 0: the bar, step, loss, speed, accuracy and time left; redrawn on a terminal,
elsewhere (a batch job's log) one line every few seconds."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

from ..measure.progress import LINE_EVERY_SECONDS, PacedLine, clock_text


def progress_text(step: int, steps: int, loss: float, images_per_s: float, accuracy: float | None,
                  seconds_left: float) -> str:
    """``step 3/10 loss 0.6931 12.50 img/s val_acc 0.750 ETA 0:12``: what the progress line shows after a step."""
    shown = "" if accuracy is None else f" val_acc {accuracy:.3f}"
    return f"step {step}/{steps} loss {loss:.4f} {images_per_s:.2f} img/s{shown} ETA {clock_text(seconds_left)}"


class TrainProgress:
    """The progress of one run of ``steps`` steps starting after step ``first_step`` (a resumed run's); the time left
    is the wall time per step so far (evaluations and checkpoints included) times the steps left."""

    def __init__(self, steps: int, enabled: bool, stream: TextIO | None = None, *, first_step: int = 0,
                 every: float = LINE_EVERY_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.line = PacedLine(steps, enabled, stream, every=every, clock=clock)
        self.steps = steps
        self.first_step = first_step

    @property
    def enabled(self) -> bool:
        return self.line.enabled

    def seconds_left(self, step: int) -> float:
        return self.line.seconds_left(step, self.first_step)

    def step(self, step: int, loss: float, images_per_s: float, accuracy: float | None) -> None:
        """The line after ``step``: on a terminal at once; elsewhere the first, the last, and then one every
        few seconds (the others are held back, the latest shown by ``finish``)."""
        if self.enabled:
            self.line.update(step, progress_text(step, self.steps, loss, images_per_s, accuracy,
                                                 self.seconds_left(step)))

    def finish(self) -> None:
        """The run ends (early, too): the latest line held back is written, a terminal's bar line ended."""
        self.line.finish()

    def note(self, text: str) -> None:
        """A line of its own (an evaluation's figures), not overwritten by the bar."""
        self.line.note(text)
