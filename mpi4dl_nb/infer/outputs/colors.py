"""Colours of inference outputs: the heat-map colour map, and one colour per class (QuPath's classification colours)."""

from __future__ import annotations

import numpy as np

COLORMAP = "inferno"
BACKGROUND = (255, 255, 255)   # cells without data (background windows, the slide's margin): white, as glass
CLASS_COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
                (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207))   # matplotlib's tab10


def colormap_lut(name: str = COLORMAP) -> np.ndarray:
    """256 x 3 uint8 colours of a matplotlib colormap."""
    import matplotlib

    return (matplotlib.colormaps[name](np.linspace(0, 1, 256))[:, :3] * 255).round().astype(np.uint8)


def colorize(values: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """Probabilities (any shape) -> RGB uint8; NaN (not computed) -> background white."""
    finite = np.isfinite(values)
    index = np.clip(np.nan_to_num(values, nan=0.0) * 255.0 + 0.5, 0, 255).astype(np.uint8)
    rgb = lut[index]
    rgb[~finite] = BACKGROUND
    return rgb


def class_color(index: int) -> tuple[int, int, int]:
    """The colour of class ``index`` (cycling through ``CLASS_COLORS``)."""
    return CLASS_COLORS[index % len(CLASS_COLORS)]
