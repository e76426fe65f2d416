"""Polygons to pixels: even-odd scanline filling of any box of a pyramid level, the same pixels whatever the box.

A pixel belongs to a polygon when its centre does, by the even-odd rule over all the polygon's rings
(an outer ring and its holes). Vertices are in level-0 pixel coordinates (QuPath's: origin at the
top-left corner of the full-resolution image); pixel ``(row, col)`` of level ``L`` has its centre at
``((col + 0.5) * d, (row + 0.5) * d)`` in those coordinates, ``d`` the level's downsample. Every
crossing is computed in the level's absolute coordinates and only then shifted into the box, so a
box filled alone equals the same box cut from the whole level (tiles of a mask agree at their seams).
Edges count half-open in y (a vertex on a scan row is crossed once), a centre exactly on a left edge
counts inside.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Box = tuple[int, int, int, int]   # half-open (r0, r1, c0, c1) in pixels of the level


def ring_edges(rings: Sequence[np.ndarray], downsample: float) -> np.ndarray:
    """Every edge of ``rings`` as rows ``(x1, y1, x2, y2)`` in pixel-centre units of the level (float64)."""
    parts = []
    for ring in rings:
        points = np.asarray(ring, dtype=np.float64) / downsample - 0.5
        parts.append(np.concatenate([points, np.roll(points, -1, axis=0)], axis=1))
    return np.concatenate(parts) if parts else np.zeros((0, 4))


def fill(rings: Sequence[np.ndarray], box: Box, downsample: float = 1.0) -> np.ndarray:
    """Boolean ``(r1 - r0, c1 - c0)``: the pixels of ``box`` whose centre lies inside ``rings`` (even-odd)."""
    r0, r1, c0, c1 = box
    height, width = r1 - r0, c1 - c0
    inside = np.zeros((height, width), dtype=bool)
    edges = ring_edges(rings, downsample)
    if not len(edges) or height <= 0 or width <= 0:
        return inside
    x1, y1, x2, y2 = edges.T
    low, high = np.minimum(y1, y2), np.maximum(y1, y2)
    first = np.maximum(np.ceil(low).astype(np.int64), r0)          # rows whose centre y satisfies low <= y < high
    last = np.minimum(np.ceil(high).astype(np.int64), r1)          # exclusive
    counts = np.maximum(last - first, 0)
    if not counts.any():
        return inside
    edge = np.repeat(np.arange(len(edges)), counts)
    row = first[edge] + (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))
    t = (row - y1[edge]) / (y2[edge] - y1[edge])
    x = x1[edge] + t * (x2[edge] - x1[edge])
    column = np.clip(np.ceil(x).astype(np.int64) - c0, 0, width)   # centres at or right of the crossing flip
    toggles = np.zeros((height, width + 1), dtype=np.int64)
    np.add.at(toggles, (row - r0, column), 1)
    return (np.cumsum(toggles[:, :width], axis=1) % 2).astype(bool)


def label_map(classes: Sequence[Sequence[Sequence[np.ndarray]]], box: Box, downsample: float = 1.0,
              background: int = 0) -> np.ndarray:
    """int64 ``(r1 - r0, c1 - c0)``: ``classes[k]`` lists class ``k``'s polygons (each a list of rings);
    their pixels get ``k``, classes drawn in order (a later class wins where they overlap), the rest
    ``background``. The polygons of one class are united (each filled by the even-odd rule on its own)."""
    r0, r1, c0, c1 = box
    out = np.full((r1 - r0, c1 - c0), background, dtype=np.int64)
    for index, polygons in enumerate(classes):
        for rings in polygons:
            points = np.concatenate(rings) / downsample - 0.5
            (x_low, y_low), (x_high, y_high) = points.min(axis=0), points.max(axis=0)
            if y_high < r0 - 1 or y_low > r1 or x_high < c0 - 1 or x_low > c1:
                continue              # no pixel centre of the box is inside: the fill would be empty
            out[fill(rings, box, downsample)] = index
    return out
