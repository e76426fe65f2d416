"""A slide's bounds (OpenSlide's ``openslide.bounds-*``): the level-0 rectangle holding data, QuPath's image (pure).

Formats such as MIRAX report scanned data inside a larger level-0 frame. QuPath's OpenSlide
server crops to these bounds (its default since v0.2): its pixel (0, 0) is OpenSlide's
(``bounds-x``, ``bounds-y``), its image ``bounds-width`` x ``bounds-height`` pixels, and every
level keeps the frame's downsample. Annotations exported from QuPath, and every output here,
use that image's coordinates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

BOUNDS_KEYS = ("openslide.bounds-x", "openslide.bounds-y", "openslide.bounds-width", "openslide.bounds-height")


@dataclass(frozen=True)
class SlideBounds:
    """The level-0 rectangle ``[x, x + width) x [y, y + height)`` of OpenSlide's frame that QuPath shows."""

    x: int
    y: int
    width: int
    height: int
    whole: bool = False      # the bounds are OpenSlide's whole frame (no bounds reported)

    @property
    def offset(self) -> bool:
        """Whether QuPath's image starts elsewhere than OpenSlide's (0, 0)."""
        return (self.x, self.y) != (0, 0)

    def level_size(self, downsample: float, stored: Sequence[int]) -> tuple[int, int]:
        """(width, height) of the bounded image at a level of ``downsample`` whose file size is ``stored``: that
        size for the whole frame, else the bounds shrunk by the downsample (rounded up: nothing cut)."""
        if self.whole:
            return int(stored[0]), int(stored[1])
        return (max(1, -int(-self.width // downsample)), max(1, -int(-self.height // downsample)))

    def describe(self) -> dict[str, int]:
        """The bounds as stored in the outputs' metadata."""
        return {"x": self.x, "y": self.y, "width": self.width, "height": self.height}


def slide_bounds(properties: Mapping[str, str], level0: Sequence[int]) -> SlideBounds:
    """QuPath's image of a slide with OpenSlide ``properties`` and level-0 ``(width, height)``: the bounds when all
    four are given as integers (as QuPath requires), else the whole frame."""
    try:
        x, y, width, height = (int(properties[key]) for key in BOUNDS_KEYS)
    except (KeyError, ValueError):
        return SlideBounds(0, 0, int(level0[0]), int(level0[1]), whole=True)
    if width <= 0 or height <= 0:
        return SlideBounds(0, 0, int(level0[0]), int(level0[1]), whole=True)
    return SlideBounds(x, y, width, height, whole=(x, y, width, height) == (0, 0, level0[0], level0[1]))
