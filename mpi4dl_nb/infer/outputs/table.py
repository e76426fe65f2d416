"""The ``.csv`` output: one row per output cell with data, its centre in level-0 pixels, its class (the most probable)
and every class's probability, written strip of rows by strip."""

from __future__ import annotations

import csv
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from .placement import CellPlacement

STRIP_CELLS = 1 << 14      # cells formatted at once


def write_csv(path: Path, probs: np.ndarray, placement: CellPlacement, class_names: Sequence[str], *,
              tick: Callable[[], None] = lambda: None) -> int:
    """Rows ``x, y, class, p_<name>...`` for every cell whose probabilities are known; returns the row count."""
    height = placement.cells_of_map(0, placement.map_shape[0], 0)[1]    # cells centred inside the slide
    width = placement.cells_of_map(0, placement.map_shape[1], 1)[1]
    rows = max(1, STRIP_CELLS // max(1, width))
    xs = placement.centre(np.arange(width, dtype=np.float64))
    names = np.array(list(class_names), dtype=object)
    written = 0
    with open(path, "w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow(["x", "y", "class", *(f"p_{name}" for name in class_names)])
        for r0 in range(0, height, rows):
            block = np.asarray(probs[:, r0:min(r0 + rows, height), :width], dtype=np.float64)
            known = np.isfinite(block).all(axis=0)
            rr, cc = np.nonzero(known)
            values = block[:, rr, cc].T
            ys = placement.centre((rr + r0).astype(np.float64))
            best = names[np.argmax(values, axis=1)] if len(rr) else names[:0]
            out.writerows([f"{x:.2f}", f"{y:.2f}", name, *(f"{v:.6g}" for v in row)]
                          for x, y, name, row in zip(xs[cc], ys, best, values))
            written += len(rr)
            tick()
    return written
