"""Where output cells lie on the slide (pure): the slide-aligned map that every output but ``.npy`` is drawn on.

Cell ``j`` (per axis) describes the input pixels ``[j*stride, j*stride + extent)`` at the
resolution read (``extent``: the training patch of a classifier, the stride of a dense
network), so its centre is ``j*stride + extent/2``. The map has one pixel per ``stride``
pixels read, covers the slide's extent from its origin, and holds cell ``j`` at map pixel
``j + shift``, ``shift = round((extent - stride) / (2*stride))``: the map pixel whose centre is
nearest the cell's (exact when ``extent - stride`` is an even multiple of the stride, as for
dense networks; else half a stride off). Map pixels without a cell (the slide's margin a patch
never centres on) hold no data. Coordinates on the map scale to level-0 pixels by
``cell_size = stride * level0_per_pixel``; its resolution is ``mpp * stride`` µm per map pixel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np

CellIndex = TypeVar("CellIndex", float, np.ndarray)


@dataclass(frozen=True)
class CellPlacement:
    """The slide-aligned map of ``out_shape`` output cells over a ``read_shape`` image read at ``mpp`` µm/px."""

    stride: int
    extent: int
    out_shape: tuple[int, int]            # output cells (rows, columns)
    read_shape: tuple[int, int]           # pixels read (height, width), the slide at the inference resolution
    level0_per_pixel: float               # level-0 pixels per pixel read (level downsample x resampling)
    mpp: float | None                     # µm per pixel read (None: unknown)

    @property
    def shift(self) -> int:
        """Map pixel of cell 0 (per axis)."""
        return int(round((self.extent - self.stride) / (2 * self.stride)))

    @property
    def map_shape(self) -> tuple[int, int]:
        """(rows, columns) of the map: the slide's extent in strides, rounded up."""
        return (-(-self.read_shape[0] // self.stride), -(-self.read_shape[1] // self.stride))

    @property
    def cell_size(self) -> float:
        """Level-0 pixels per map pixel (per axis)."""
        return self.stride * self.level0_per_pixel

    @property
    def map_mpp(self) -> float | None:
        """µm per map pixel."""
        return None if self.mpp is None else self.mpp * self.stride

    def cells_of_map(self, start: int, stop: int, axis: int) -> tuple[int, int]:
        """The output cells of map pixels ``[start, stop)`` along ``axis`` (0 rows, 1 columns): a cell range,
        possibly empty, that lies ``shift`` below it."""
        cells = self.out_shape[axis]
        return (min(max(start - self.shift, 0), cells), min(max(stop - self.shift, 0), cells))

    def centre(self, cell: CellIndex) -> CellIndex:
        """Level-0 coordinate of the centre of cell ``cell`` (either axis; a number or an array of them)."""
        return (cell * self.stride + self.extent / 2.0) * self.level0_per_pixel

    def describe(self) -> dict[str, object]:
        """The placement as stored in the outputs' metadata."""
        return {"map_shape": list(self.map_shape), "cell_shift": self.shift, "level0_pixels_per_map_pixel":
                self.cell_size, "map_mpp": self.map_mpp, "cell_extent": self.extent, "stride": self.stride}
