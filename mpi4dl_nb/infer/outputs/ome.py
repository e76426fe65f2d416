"""The ``.ome.tif`` output: the map's probabilities as a pyramidal OME-TIFF, one named float32 channel per class (NaN:
no data), physical pixel sizes in µm, coarser levels in SubIFDs (as QuPath, napari and Bio-Formats read them)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from .pyramid import MapPyramid


def channel_tiles(pyramid: MapPyramid, level: int) -> Iterator[np.ndarray]:
    """The tiles of ``level``, channel after channel (OME-TIFF keeps each channel in its own page)."""
    for channel in range(pyramid.classes):
        for _, _, block in pyramid.tiles(level):
            yield np.ascontiguousarray(block[channel], dtype=np.float32)


def ome_metadata(pyramid: MapPyramid, class_names: Sequence[str],
                 description: Mapping[str, object]) -> dict[str, object]:
    """OME-XML fields as tifffile writes them: axes, channel names, physical size of a level-0 map pixel."""
    meta: dict[str, object] = {"axes": "CYX", "Name": str(description.get("slide", "map")),
                               "Channel": {"Name": list(class_names)}}
    mpp = pyramid.placement.map_mpp
    if mpp is not None:
        meta.update({"PhysicalSizeX": mpp, "PhysicalSizeXUnit": "µm", "PhysicalSizeY": mpp,
                     "PhysicalSizeYUnit": "µm"})
    return meta


def write_ome_tiff(path: Path, pyramid: MapPyramid, *, class_names: Sequence[str],
                   description: Mapping[str, object]) -> None:
    """A pyramidal OME-TIFF of the map's probabilities at ``path``: level 0 in the main pages (one per class),
    each coarser level in their SubIFDs, resolution tags beside the OME-XML sizes, streamed tile by tile."""
    import tifffile

    levels = pyramid.levels
    mpp = pyramid.placement.map_mpp
    height0, width0 = levels[0]
    big = pyramid.classes * height0 * width0 * 4 > 2**31
    with tifffile.TiffWriter(path, bigtiff=big, ome=True) as tw:
        for level, (height, width) in enumerate(levels):
            pixel = None if mpp is None else mpp * width0 / width
            tw.write(channel_tiles(pyramid, level), shape=(pyramid.classes, height, width), dtype=np.float32,
                     tile=(pyramid.tile, pyramid.tile), photometric="minisblack", compression="zlib",
                     subifds=len(levels) - 1 if level == 0 else None, subfiletype=1 if level else 0,
                     metadata=ome_metadata(pyramid, class_names, description) if level == 0 else None,
                     resolution=None if pixel is None else (1e4 / pixel, 1e4 / pixel),
                     resolutionunit=None if pixel is None else "CENTIMETER")
