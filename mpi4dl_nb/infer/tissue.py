"""Tissue mask of a slide from a low-resolution overview, and the tissue fraction under a window."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..data.tissue_mask import TissueMethod, tissue_mask
from ..spatial.geometry import Box

OVERVIEW_SIDE = 2048


@dataclass(frozen=True)
class TissueMap:
    """A boolean tissue mask covering a ``height x width`` level (each mask pixel a block of the level)."""

    mask: np.ndarray
    height: int
    width: int

    @classmethod
    def from_overview(cls, rgb: np.ndarray, height: int, width: int,
                      method: TissueMethod = TissueMethod.SATURATION) -> TissueMap:
        """Mask of stained tissue in an RGB overview of a ``height x width`` level (``method``: what counts as tissue,
        an Otsu threshold computed on this overview)."""
        return cls(tissue_mask(rgb, method), height, width)

    def fraction(self, box: Box) -> float:
        """Share of tissue under ``box`` (pixels of the level; parts past the slide count as background)."""
        r0, r1, c0, c1 = box
        mh, mw = self.mask.shape
        sy, sx = mh / self.height, mw / self.width
        y0, y1 = int(np.floor(max(r0, 0) * sy)), int(np.ceil(min(r1, self.height) * sy))
        x0, x1 = int(np.floor(max(c0, 0) * sx)), int(np.ceil(min(c1, self.width) * sx))
        area = max(1, (r1 - r0) * (c1 - c0))
        inside = max(0, min(r1, self.height) - max(r0, 0)) * max(0, min(c1, self.width) - max(c0, 0))
        if y1 <= y0 or x1 <= x0 or inside == 0:
            return 0.0
        return float(self.mask[y0:y1, x0:x1].mean()) * inside / area
