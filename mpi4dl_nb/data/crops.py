"""The centre crop of an image file at a resolution: its pixels area-resampled, its labels by majority, box by box.

A tile folder (and the images and masks of a mask folder) is read at ``--mpp`` by shrinking each file
from its own MPP (its resolution tags, or ``--source-mpp``) with ``resolution.AreaResampler``, then
cutting the centre ``--image-size`` crop of the shrunk image. The resampler's weights depend only on
global pixel coordinates, so any box of the crop read alone (a spatial rank's tile) is bitwise the same
box of the whole crop. Masks take, per pixel, the label covering most of its footprint: class indices
are never interpolated.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .dataset import Box, check_box
from .resolution import AreaResampler, LevelChoice, common_mpp, image_mpp

NATIVE = LevelChoice(0, 1.0, None)   # the file as it is
Reader = Callable[[Box], np.ndarray]  # pixels of a box of the file (zeros past its edges)


@dataclass(frozen=True)
class CentreCrop:
    """The centre ``size`` crop of a ``width x height`` image read at ``choice``'s resolution (shrunk by its scale)."""

    width: int
    height: int
    size: int
    choice: LevelChoice = NATIVE

    @property
    def extent(self) -> tuple[int, int]:
        """(width, height) of the image at the resolution read."""
        return self.choice.extent((self.width, self.height))

    def problem(self) -> str | None:
        """Why the crop does not fit the image (None: it does), to follow the file's name."""
        width, height = self.extent
        if min(width, height) >= self.size:
            return None
        fix = f"use --image-size <= {min(width, height)}"
        if not self.choice.resampled:
            return f"is {width}x{height}, smaller than --image-size {self.size}; {fix}"
        return (f"is {self.width}x{self.height}, {width}x{height} at {self.choice.mpp:g} µm/px: smaller than "
                f"--image-size {self.size}; {fix} or a finer --mpp")

    def target(self, box: Box | None) -> Box:
        """``box`` of the crop (default: all of it) in pixels of the image at the resolution read."""
        r0, r1, c0, c1 = check_box(box, self.size)
        width, height = self.extent
        top, left = (height - self.size) // 2, (width - self.size) // 2
        return top + r0, top + r1, left + c0, left + c1

    def pixels(self, read: Reader, box: Box | None = None) -> np.ndarray:
        """``box`` of the crop's pixels (uint8 ``(h, w, C)``), from ``read`` of the file's pixels."""
        target = self.target(box)
        return AreaResampler(self.choice.scale).read(read, target) if self.choice.resampled else read(target)

    def labels(self, read: Reader, box: Box | None = None) -> np.ndarray:
        """``box`` of the crop's labels (``(h, w)``), from ``read`` of the file's labels: the majority label per pixel
        when resampled."""
        target = self.target(box)
        return AreaResampler(self.choice.scale).vote(read, target) if self.choice.resampled else read(target)


def folder_mpp(files: Iterable[Path], source_mpp: float | None = None) -> float | None:
    """The one MPP of image files: ``source_mpp`` when given, else their resolution tags (None: a file carries none,
    read until the first such; or they differ)."""
    if source_mpp is not None:
        return source_mpp
    found: list[float] = []
    for path in files:
        mpp = image_mpp(path)
        if mpp is None:
            return None
        found.append(mpp)
    return common_mpp(found)
