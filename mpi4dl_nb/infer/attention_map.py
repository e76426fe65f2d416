"""Where a whole-slide model looked (pure): the attention weights or arg-max shares over a canvas's trunk cells, merged
from tiles, and that map placed on the slide at the trunk's output stride.

``attention`` heads: the softmax of the attention logits over every position of the canvas (the weights the pool
gave each cell; they sum to 1 over the canvas). ``max`` heads: for each cell, the share of the feature channels
whose maximum over the canvas lies there (the position whose features reached the classifier; ties go to the
first position in row-major order, as the pool breaks them; channels constant over the canvas left out), so the map
also sums to 1 over the canvas. A slide encoder (``--slide-encoder``): the class token's attention to each cell in its
last block, averaged over the heads (``class attention``; it sums to 1 less the class token's attention to itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..data.canvas import CanvasPlacement
from ..data.dataset import Box
from ..models.pools import PoolKind

TOP_PERCENTILE = 95.0      # the GeoJSON traces cells at or above this percentile of the map over the canvas ...
TOP_MASS = 0.5             # ... that are also among the fewest highest cells holding this share of the map's sum
MAP_NAMES = {PoolKind.ATTENTION: "attention", PoolKind.MAX: "max share"}
CLASS_MAP_NAME = "class attention"     # the slide encoder's class token over the cells


def looks(pool: PoolKind) -> bool:
    """Whether a head of this pool has a map of where it looked (attention and max; average pools have none)."""
    return pool in MAP_NAMES


def attention_weights(scores: torch.Tensor) -> np.ndarray:
    """The attention logits of every cell of a canvas (H', W') as the pool's softmax weights (float64, sum 1)."""
    return torch.softmax(scores.to(torch.float64).flatten(), 0).view(scores.shape).numpy()


def class_attention_cells(weights: torch.Tensor, shape: tuple[int, int]) -> np.ndarray:
    """The class token's attention (heads, 1 + H' * W': itself first, then the cells row-major) as a (H', W') map of
    the cells, averaged over the heads (float64)."""
    return weights.to(torch.float64).mean(0)[1:].reshape(shape).numpy()


def tile_extrema(features: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per channel of a tile's features (C, h, w): its maximum, the first position holding it (row-major in the
    tile, as the pool's serial kernel picks it) and its minimum."""
    values, index = features.detach().flatten(-2).max(-1)
    low = features.detach().flatten(-2).amin(-1)
    return values.to(torch.float64).numpy(), index.numpy().astype(np.int64), low.to(torch.float64).numpy()


def canvas_positions(index: np.ndarray, box: Box, width: int) -> np.ndarray:
    """Row-major positions in a tile at ``box`` (r0, r1, c0, c1) as row-major positions in the whole canvas, which is
    ``width`` cells wide."""
    tile_width = box[3] - box[2]
    return (box[0] + index // tile_width) * width + box[2] + index % tile_width


def first_maxima(values: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Per channel, the canvas position of its maximum from every tile's (tiles, C) maxima and their positions: the
    largest value, and among tiles that hold it the first position in row-major order."""
    best = values.max(axis=0)
    return np.where(values == best, positions, np.iinfo(np.int64).max).min(axis=0)


def max_shares(first: np.ndarray, informative: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Per cell of a (H', W') canvas, the share of the informative channels whose first maximum lies there (float64,
    sum 1; all zero when no channel is informative). A channel constant over the canvas is not informative: its
    arg-max is the first cell by convention and says nothing of where the model looked."""
    counts = np.bincount(first[informative], minlength=shape[0] * shape[1]).astype(np.float64)
    return (counts / max(int(informative.sum()), 1)).reshape(shape)


def top_threshold(values: np.ndarray, percentile: float = TOP_PERCENTILE, mass: float = TOP_MASS) -> float:
    """The least map value the GeoJSON's regions hold: the ``percentile``-th percentile of the cells with data, raised
    to the value of the last of the fewest highest cells that hold ``mass`` of the map's sum (so a peaked map gives
    its peaks, not cells of near-zero weight, and a flat one its top cells); inf for a map without data or weight."""
    finite = np.sort(values[np.isfinite(values)])[::-1]
    total = float(finite.sum()) if finite.size else 0.0
    if total <= 0:
        return float("inf")
    holding = int(np.searchsorted(np.cumsum(finite), mass * total))
    return max(float(np.percentile(finite, percentile)), float(finite[min(holding, finite.size - 1)]))


@dataclass(frozen=True)
class SlideMap:
    """A canvas's map placed on its slide: one map pixel per ``stride`` pixels read, covering the whole slide
    (``shape`` = the slide's extent in strides, rounded up); map pixel ``(i, j)`` covers pixels read
    ``[i*stride, (i+1)*stride)``. The canvas's cells land at ``offset`` (its corner in strides, rounded to the nearest
    map pixel: within half a stride); map pixels the canvas does not cover, and canvas cells beyond the slide, have no
    data (NaN)."""

    values: np.ndarray          # (rows, columns) float64, NaN without data
    stride: int
    offset: tuple[int, int]     # map pixel of the canvas's cell (0, 0) (may be negative)


def on_slide(cells: np.ndarray, placement: CanvasPlacement) -> SlideMap:
    """``cells`` (H', W'), the map over ``placement``'s canvas, placed on the slide's map grid."""
    stride = placement.size // int(cells.shape[0])
    width, height = placement.extent
    rows, cols = -(-height // stride), -(-width // stride)
    top, left = int(round(placement.top / stride)), int(round(placement.left / stride))
    values = np.full((rows, cols), np.nan)
    r0, r1 = max(top, 0), min(top + cells.shape[0], rows)
    c0, c1 = max(left, 0), min(left + cells.shape[1], cols)
    if r0 < r1 and c0 < c1:
        values[r0:r1, c0:c1] = cells[r0 - top:r1 - top, c0 - left:c1 - left]
    return SlideMap(values, stride, (top, left))
