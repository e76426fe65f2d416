"""CIFAR-10 from its standard binary batches (``data_batch_N.bin`` / ``test_batch.bin``: label byte + 3x32x32 bytes)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .dataset import Box, check_box
from .files import require_path

SIDE = 32
RECORD = 1 + 3 * SIDE * SIDE  # 3073 bytes: label, then the R, G and B planes row-major
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def find_batches(datapath: str | Path, train: bool = True) -> list[Path]:
    """The binary batch files under ``datapath`` (or its ``cifar-10-batches-bin`` folder)."""
    root = require_path(datapath)
    pattern = "data_batch_*.bin" if train else "test_batch.bin"
    for folder in (root, root / "cifar-10-batches-bin"):
        files = sorted(folder.glob(pattern)) if folder.is_dir() else []
        if files:
            return files
    hint = ""
    if any((folder / "data_batch_1").exists() for folder in (root, root / "cifar-10-batches-py")):
        hint = " (found the Python-pickle version; use the binary version cifar-10-binary.tar.gz)"
    raise FileNotFoundError(f"--datapath {str(datapath)!r} holds no CIFAR-10 binary batches "
                            f"{pattern}{hint}")


class Cifar10Dataset:
    """CIFAR-10 images resized (bilinear) to ``image_size`` when it is not 32, labels 0..9."""

    def __init__(self, datapath: str | Path, image_size: int = SIDE, *, train: bool = True,
                 num_classes: int = 10) -> None:
        if num_classes < len(CLASSES):
            raise ValueError(f"CIFAR-10 has 10 classes but --num-classes is {num_classes}; "
                             f"use --num-classes 10")
        parts = []
        for path in find_batches(datapath, train):
            size = path.stat().st_size
            if size == 0 or size % RECORD:
                raise ValueError(f"{path} is {size} bytes, not a whole number of {RECORD}-byte "
                                 f"CIFAR-10 records; is it a binary-version batch?")
            parts.append(np.fromfile(path, dtype=np.uint8).reshape(-1, RECORD))
        self.records = np.concatenate(parts)
        bad = self.records[:, 0] >= len(CLASSES)
        if bad.any():
            raise ValueError(f"label byte {int(self.records[bad][0, 0])} > 9 in the CIFAR-10 "
                             f"batches under {datapath}; the files are not CIFAR-10 binary batches")
        self.image_size = image_size
        self.channels = 3
        self.num_classes = num_classes

    def __len__(self) -> int:
        return len(self.records)

    def label(self, index: int) -> int:
        return int(self.records[index, 0])

    def read(self, index: int, box: Box | None = None) -> torch.Tensor:
        r0, r1, c0, c1 = check_box(box, self.image_size)
        image = torch.from_numpy(self.records[index, 1:].reshape(3, SIDE, SIDE).astype(np.float32))
        image = image / 255.0
        if self.image_size != SIDE:
            image = F.interpolate(image[None], size=(self.image_size, self.image_size),
                                  mode="bilinear", align_corners=False)[0]
        return image[:, r0:r1, c0:c1].contiguous()
