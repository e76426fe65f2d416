"""Otsu's threshold: the level of a 256-bin histogram that splits it into two classes of the largest between-class
variance (Otsu 1979), in numpy."""
from __future__ import annotations

import numpy as np

LEVELS = 256


def otsu_level(values: np.ndarray) -> int:
    """The level ``k`` (0..254) whose split of ``values`` (integers in 0..255) into ``<= k`` and ``> k`` has the largest
    between-class variance ``w0 * w1 * (m0 - m1)**2`` (``w``: the classes' shares, ``m``: their means); the first
    such level on a tie (a gap of empty levels between the classes: its lowest level). One level occupied: that
    level (nothing lies above it)."""
    flat = np.asarray(values).ravel()
    if flat.size and (flat.min() < 0 or flat.max() >= LEVELS):
        raise ValueError(f"Otsu's threshold takes levels 0..{LEVELS - 1}, got {flat.min()}..{flat.max()}")
    counts = np.bincount(flat.astype(np.int64), minlength=LEVELS).astype(np.float64)
    weight_low = np.cumsum(counts)[:-1]                      # pixels at or below each level k = 0..254 (exact)
    mass_low = np.cumsum(counts * np.arange(LEVELS))[:-1]    # their sum of levels (exact: integers below 2**53)
    weight_high = counts.sum() - weight_low
    mass_high = float(np.dot(counts, np.arange(LEVELS))) - mass_low
    both = (weight_low > 0) & (weight_high > 0)
    if not both.any():
        return int(np.argmax(counts)) if flat.size else 0
    with np.errstate(divide="ignore", invalid="ignore"):
        between = weight_low * weight_high * (mass_low / weight_low - mass_high / weight_high) ** 2
    return int(np.argmax(np.where(both, between, -1.0)))
