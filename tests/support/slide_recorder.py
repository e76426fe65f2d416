"""An OpenSlide stand-in that records every read_region call (shared by slide tests)."""

from __future__ import annotations

from pathlib import Path

from mpi4dl_nb.data.pathology import open_slide


class ReadRecorder:
    """Wraps an OpenSlide object, recording every read_region call."""

    def __init__(self, slide) -> None:
        self.slide = slide
        self.calls: list[tuple[tuple[int, int], int, tuple[int, int]]] = []

    @classmethod
    def open(cls, path: Path) -> ReadRecorder:
        """Opener for ``SlideDataset(..., opener=ReadRecorder.open)``: the slide at ``path``, recorded."""
        return cls(open_slide(path))

    def read_region(self, location, level, size):
        self.calls.append((tuple(location), level, tuple(size)))
        return self.slide.read_region(location, level, size)

    def __getattr__(self, name):
        return getattr(self.slide, name)
