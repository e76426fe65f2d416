"""The ``.geojson`` output: each class's regions on the slide-aligned map as polygons with holes, in level-0 pixel
coordinates, as QuPath imports them (a FeatureCollection; ``classification {name, color}``, ``measurements``).

A map pixel belongs to the class of highest probability when that probability reaches the
threshold (none for a segmentation network's label map, by default); regions are traced
exactly along pixel edges (``contours.py``), strip of rows by strip, and written as they close.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import TextIO

import numpy as np

from .colors import class_color
from .contours import RegionTracer, TracedRegion
from .pyramid import MapPyramid

STRIP_CELLS = 1 << 14     # map pixels traced at once (rows of the map, at least one)


def labels_of(block: np.ndarray, threshold: float | None, excluded: Collection[int]) -> np.ndarray:
    """Per map pixel, the class it belongs to, or -1 (no data, below ``threshold``, or an excluded class)."""
    known = np.isfinite(block).all(axis=0)
    filled = np.nan_to_num(block, nan=-1.0)
    labels = np.argmax(filled, axis=0).astype(np.int64)
    if threshold is not None:
        known &= filled.max(axis=0) >= threshold
    for label in excluded:
        known &= labels != label
    labels[~known] = -1
    return labels


def feature(region: TracedRegion, class_names: Sequence[str], cell: float, mpp: float | None) -> dict[str, object]:
    """One region as a QuPath GeoJSON feature (map pixel corners scaled to level-0 pixels)."""
    def ring(points: np.ndarray) -> list[list[float]]:
        return np.round(points * cell, 3).tolist()

    area = region.area * cell * cell
    measurements: dict[str, float] = {"Area px^2": round(area, 3)}
    if mpp is not None:
        measurements["Area µm^2"] = round(area * mpp * mpp, 3)
    for index, name in enumerate(class_names):
        measurements[f"Mean P({name})"] = round(float(region.sums[index] / max(region.area, 1e-12)), 6)
    return {"type": "Feature",
            "geometry": {"type": "Polygon", "coordinates": [ring(region.outer), *(ring(h) for h in region.holes)]},
            "properties": {"objectType": "annotation", "isLocked": False,
                           "classification": {"name": class_names[region.label],
                                              "color": list(class_color(region.label))},
                           "measurements": measurements}}


def write_geojson(path: Path, pyramid: MapPyramid, *, class_names: Sequence[str], threshold: float | None,
                  excluded: Collection[int] = (), min_area: float = 0.0, mpp: float | None = None,
                  tick: Callable[[], None] = lambda: None) -> dict[str, int]:
    """Trace the map's regions into a FeatureCollection at ``path``; ``min_area`` in level-0 pixels squared,
    ``mpp`` level 0's µm per pixel (for areas in µm²). Returns the number of regions per class name."""
    height, width = pyramid.levels[0]
    cell = pyramid.placement.cell_size
    tracer = RegionTracer(width, pyramid.classes, pyramid.classes, min_area=min_area / (cell * cell))
    rows = max(1, STRIP_CELLS // max(1, width))
    counts = {name: 0 for name in class_names}
    with open(path, "w") as handle:
        handle.write('{"type": "FeatureCollection", "features": [')
        first = True

        def emit(regions: Iterable[TracedRegion]) -> None:
            nonlocal first
            for region in regions:
                _write(handle, feature(region, class_names, cell, mpp), first)
                counts[class_names[region.label]] += 1
                first = False

        for r0 in range(0, height, rows):
            block = pyramid.block(0, r0, min(r0 + rows, height), 0, width)
            emit(tracer.feed(labels_of(block, threshold, excluded), block.astype(np.float64)))
            tick()
        emit(tracer.finish())
        handle.write("\n]}\n")
    return counts


def _write(handle: TextIO, item: dict[str, object], first: bool) -> None:
    handle.write(("\n" if first else ",\n") + json.dumps(item, ensure_ascii=False))
