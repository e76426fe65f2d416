"""The probability array of a run (a .npy file filled window by window, memory-mapped) and its resume record."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..spatial.geometry import Box

Fingerprint = dict[str, object]  # JSON values a partial output must share with the run that continues it


def work_path(base: Path) -> Path:
    """Where the probabilities accumulate during the run (and stay for ``--resume``): beside ``base``."""
    return base.with_name(base.name + ".partial.npy")


def progress_path(work: Path) -> Path:
    return work.with_name(work.name + ".json")


class HeatmapStore:
    """The ``(classes, H', W')`` probability array in a .npy file, written box by box (memory-mapped)."""

    def __init__(self, path: Path, shape: tuple[int, int, int], dtype: np.dtype, *, create: bool) -> None:
        self.path = path
        if create:
            self.array = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
        else:
            self.array = np.load(path, mmap_mode="r+")
            if self.array.shape != shape or self.array.dtype != dtype:
                raise ValueError(f"{path} holds a {self.array.dtype} array of shape {self.array.shape}, "
                                 f"not {np.dtype(dtype)} {shape}")

    def write(self, box: Box, values: np.ndarray) -> None:
        r0, r1, c0, c1 = box
        self.array[:, r0:r1, c0:c1] = values

    def fill(self, box: Box, value: float = float("nan")) -> None:
        r0, r1, c0, c1 = box
        self.array[:, r0:r1, c0:c1] = value

    def flush(self) -> None:
        self.array.flush()

    def close(self) -> None:
        self.flush()
        del self.array


@dataclass(frozen=True)
class ResumeRecord:
    """A partial output's resume record: what made it, and the output rows ``[0, rows_done)`` that are final."""

    fingerprint: Fingerprint
    rows_done: int


def save_progress(path: Path, fingerprint: Fingerprint, rows_done: int) -> None:
    """Record atomically that output rows ``[0, rows_done)`` are final (temporary file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        json.dump({"fingerprint": fingerprint, "rows_done": rows_done}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def load_progress(path: Path) -> ResumeRecord | None:
    if not path.is_file():
        return None
    with open(path) as handle:
        data = json.load(handle)
    return ResumeRecord(dict(data["fingerprint"]), int(data["rows_done"]))
