"""Write an RGB image as a pyramidal tiled TIFF that OpenSlide opens, with its µm per pixel in resolution tags."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def write_slide(path: str | Path, image: np.ndarray, *, levels: int = 3, tile: int = 64,
                mpp: float | None = None, averaged: bool = False) -> Path:
    """``image`` (H, W, 3) uint8 as one TIFF page per pyramid level (each half the one before: every other pixel,
    or with ``averaged`` the mean of each 2x2 block as scanners reduce; reduced pages marked), tiled,
    zlib-compressed; ``mpp``: level 0's µm per pixel, written as resolution in pixels per cm."""
    import tifffile

    path = Path(path)
    with tifffile.TiffWriter(path) as writer:
        level = image
        for index in range(levels):
            per_cm = None if mpp is None else 1e4 / (mpp * 2 ** index)
            writer.write(np.ascontiguousarray(level), tile=(tile, tile), compression="zlib", photometric="rgb",
                         subfiletype=1 if index else 0, metadata=None,
                         resolution=None if per_cm is None else (per_cm, per_cm),
                         resolutionunit=None if per_cm is None else "CENTIMETER")
            level = halved(level) if averaged else level[::2, ::2]
    return path


def halved(image: np.ndarray) -> np.ndarray:
    """``image`` at half the size: the rounded mean of each 2x2 block (an odd last row or column dropped)."""
    height, width = image.shape[0] // 2 * 2, image.shape[1] // 2 * 2
    blocks = image[:height, :width].astype(np.float32).reshape(height // 2, 2, width // 2, 2, -1)
    return np.rint(blocks.mean(axis=(1, 3))).astype(np.uint8)
