"""The held-out evaluation's progress line on rank 0: batches and images done, images per second, time left."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

from ..measure.progress import LINE_EVERY_SECONDS, PacedLine, clock_text


def held_out_text(batch: int, batches: int, images: int, total: int, images_per_s: float,
                  seconds_left: float) -> str:
    """``evaluate batch 3/10 images 24/80 12.50 img/s ETA 0:12``: the line after a batch."""
    return (f"evaluate batch {batch}/{batches} images {images}/{total} {images_per_s:.2f} img/s "
            f"ETA {clock_text(seconds_left)}")


class HeldOutProgress:
    """The progress of ``batches`` batches of ``batch_size`` over ``images`` images (the last batch filled up with
    repeats, which do not count); speed and time left from the wall time since it was made."""

    def __init__(self, batches: int, batch_size: int, images: int, enabled: bool, stream: TextIO | None = None, *,
                 every: float = LINE_EVERY_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.line = PacedLine(batches, enabled, stream, every=every, clock=clock)
        self.batches, self.batch_size, self.images = batches, batch_size, images

    def batch_done(self, done: int) -> None:
        """``done`` batches are through (every rank runs every batch: this rank's count stands for all)."""
        if not self.line.enabled:
            return
        images = min(done * self.batch_size, self.images)
        self.line.update(done, held_out_text(done, self.batches, images, self.images,
                                             images / max(self.line.elapsed(), 1e-9), self.line.seconds_left(done)))

    def finish(self) -> None:
        """The batches end (early, too): the latest line held back is written, a terminal's bar line ended."""
        self.line.finish()
