"""An OpenSlide stand-in that records every read_region call (shared by slide tests)."""

from __future__ import annotations


class ReadRecorder:
    """Wraps an OpenSlide object, recording every read_region call."""

    def __init__(self, slide) -> None:
        self.slide = slide
        self.calls: list[tuple[tuple[int, int], int, tuple[int, int]]] = []

    def read_region(self, location, level, size):
        self.calls.append((tuple(location), level, tuple(size)))
        return self.slide.read_region(location, level, size)

    def __getattr__(self, name):
        return getattr(self.slide, name)
