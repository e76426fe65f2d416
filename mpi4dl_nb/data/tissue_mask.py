"""What counts as tissue in an RGB image (a slide's low-resolution overview): HSV saturation above a fixed threshold,
or above Otsu's threshold of the image's own saturation (TissueMethod); near-black pixels never."""
from __future__ import annotations

import numpy as np

from ..config import Choice, parse_choice
from .otsu import LEVELS, otsu_level

SATURATION_TISSUE = 0.07   # HSV saturation above which a pixel counts as stained tissue (--tissue saturation)
DARKEST_BACKGROUND = 20    # max channel below this is void/black, not tissue


class TissueMethod(Choice):
    """``--tissue``: a pixel's HSV saturation judged tissue against the fixed SATURATION_TISSUE (``saturation``), or
    against Otsu's threshold of the image it is in (``otsu``: one per slide overview, as CLAM and TIAToolbox)."""

    SATURATION = "saturation"
    OTSU = "otsu"

    @classmethod
    def parse(cls, text: object) -> TissueMethod:
        """``--tissue`` (any case); ConfigError naming the methods otherwise."""
        return parse_choice(cls, str(text).strip().lower(), "--tissue", f"one of {', '.join(cls.values())}")


def saturation(rgb: np.ndarray) -> np.ndarray:
    """HSV saturation ``(max - min) / max`` of an ``(H, W, 3)`` RGB image, float32 in 0..1 (0 for black)."""
    pixels = rgb.astype(np.float32)
    high, low = pixels.max(axis=2), pixels.min(axis=2)
    return (high - low) / np.maximum(high, 1.0)


def quantised(values: np.ndarray) -> np.ndarray:
    """Values in 0..1 as the levels 0..255 nearest them."""
    return np.rint(np.clip(values, 0.0, 1.0) * (LEVELS - 1)).astype(np.uint8)


def tissue_mask(rgb: np.ndarray, method: TissueMethod = TissueMethod.SATURATION) -> np.ndarray:
    """Boolean mask of stained tissue in ``rgb``: saturated above ``method``'s threshold and not black (background is
    white/grey glass). Otsu's threshold is that of the saturation, quantised to 256 levels, of the pixels that are not
    black (the noisy saturation of a black border would pull it up)."""
    pixels = saturation(rgb)
    not_black = rgb.max(axis=2) > DARKEST_BACKGROUND
    if method is TissueMethod.SATURATION:
        return (pixels > SATURATION_TISSUE) & not_black
    levels = quantised(pixels)
    return (levels > otsu_level(levels[not_black])) & not_black    # void's noisy saturation left out of the split

