"""Synthetic images: uniform noise generated block by block, so any region is cheap to read alone."""
from __future__ import annotations

import numpy as np
import torch

from .dataset import Box, check_box

BLOCK = 32  # pixels per side of one independently seeded noise block


class SyntheticDataset:
    """``num_samples`` random ``channels x image_size^2`` images with random labels, reproducible by ``seed``.

    Pixel block ``(i, j)`` of image ``n`` depends only on ``(seed, n, i, j)``: a tile read
    generates only the blocks it overlaps and equals the same crop of the full image.
    """

    def __init__(self, image_size: int, num_classes: int = 10, num_samples: int = 1024, *,
                 channels: int = 3, seed: int = 0) -> None:
        if image_size < 1 or num_classes < 1 or num_samples < 1 or channels < 1:
            raise ValueError("image_size, num_classes, num_samples and channels must be >= 1, got "
                             f"{image_size}, {num_classes}, {num_samples}, {channels}")
        self.image_size = image_size
        self.num_classes = num_classes
        self.num_samples = num_samples
        self.channels = channels
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"image {index} outside a synthetic dataset of {self.num_samples}")

    def label(self, index: int) -> int:
        self._check_index(index)
        return int(np.random.default_rng([self.seed, index, 1]).integers(self.num_classes))

    def _block(self, index: int, i: int, j: int) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, index, 0, i, j])
        return torch.from_numpy(rng.random((self.channels, BLOCK, BLOCK), dtype=np.float32))

    def read(self, index: int, box: Box | None = None) -> torch.Tensor:
        self._check_index(index)
        r0, r1, c0, c1 = check_box(box, self.image_size)
        out = torch.empty(self.channels, r1 - r0, c1 - c0)
        for i in range(r0 // BLOCK, (r1 - 1) // BLOCK + 1):
            for j in range(c0 // BLOCK, (c1 - 1) // BLOCK + 1):
                block = self._block(index, i, j)
                top, left = i * BLOCK, j * BLOCK
                a0, a1 = max(r0, top), min(r1, top + BLOCK)
                b0, b1 = max(c0, left), min(c1, left + BLOCK)
                out[:, a0 - r0:a1 - r0, b0 - c0:b1 - c0] = block[:, a0 - top:a1 - top,
                                                                 b0 - left:b1 - left]
        return out
