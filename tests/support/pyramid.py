"""Test slides: a pyramidal tiled JPEG TIFF that OpenSlide opens."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_pyramid(path: Path, image: np.ndarray, levels: int = 3, tile: int = 64) -> None:
    """A pyramidal tiled JPEG TIFF (one page per level, reduced pages marked) that OpenSlide opens."""
    import tifffile

    with tifffile.TiffWriter(path) as tw:
        level = image
        for index in range(levels):
            tw.write(level, tile=(tile, tile), compression="jpeg", photometric="rgb",
                     subfiletype=1 if index else 0, metadata=None)
            level = level[::2, ::2]
