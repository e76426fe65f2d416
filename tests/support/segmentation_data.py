"""Segmentation test data: a folder of ``images/`` with their ``masks/`` (3 classes, some pixels ignored)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

IGNORED = 255


def write_pairs(root: Path, count: int = 8, size: int = 64, seed: int = 0, ignored: bool = False) -> Path:
    """``count`` image/mask pairs of 3 classes: a disc (1) and a corner block (2) on background (0), the
    image's colours following the mask; ``ignored``: a band of pixels labelled ``IGNORED``."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    rows, cols = np.mgrid[0:size, 0:size]
    for k in range(count):
        cx, cy, r = rng.uniform(0.25 * size, 0.75 * size, 3)
        mask = np.zeros((size, size), np.uint8)
        mask[(cols - cx) ** 2 + (rows - cy) ** 2 < (r / 3 + 4) ** 2] = 1
        mask[(cols > rng.integers(0, size * 3 // 4)) & (rows > rng.integers(size // 2, size - 4))] = 2
        if ignored:
            mask[rng.integers(0, size - 3):][:3] = IGNORED
        noise = rng.integers(0, 60, (size, size, 3))
        image = (noise + np.stack([mask % 3 * 90, 200 - mask % 3 * 50, 120 + mask % 3 * 30], -1)).clip(0, 255)
        Image.fromarray(image.astype(np.uint8)).save(root / "images" / f"tile{k}.png")
        Image.fromarray(mask).save(root / "masks" / f"tile{k}.png")
    return root
