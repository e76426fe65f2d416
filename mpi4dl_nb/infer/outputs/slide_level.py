"""What slide-level inference writes into ``--output DIR``: ``slides.csv`` (one prediction per slide, the columns of
``evaluate --slide-csv``) and, per slide of an attention or max head, its map as a slide-aligned pyramidal OME-TIFF
(float32, MPP) and the GeoJSON regions of its highest cells."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...config import ConfigError
from ...data.canvas import CanvasPlacement
from ..attention_map import SlideMap, top_threshold
from .finish import replacing
from .geojson import write_geojson
from .kinds import check_folder
from .ome import write_ome_tiff
from .placement import CellPlacement
from .pyramid import MapPyramid

SLIDES_CSV = "slides.csv"


@dataclass(frozen=True)
class SlideRow:
    """One line of ``slides.csv``: a slide's prediction (patient and label when a manifest gives them)."""

    slide: str
    probabilities: tuple[float, ...]
    patient: str = ""
    label: str = ""

    def predicted(self, classes: Sequence[str]) -> str:
        return classes[int(np.argmax(self.probabilities))]


def map_paths(folder: Path, slide: str, name: str) -> tuple[Path, Path]:
    """The map's OME-TIFF and GeoJSON of ``slide`` in ``folder`` (``name``: attention, max share)."""
    stem = f"{slide}.{name.replace(' ', '-')}"
    return folder / f"{stem}.ome.tif", folder / f"{stem}.geojson"


def check_output_folder(folder: Path, overwrite: bool) -> None:
    """``--output DIR``: a folder (made when missing, in a folder that can take it) that can take new files, without
    an earlier ``slides.csv`` unless ``--overwrite``."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError("--output", f"{folder} is a file; a whole-slide model writes a folder of outputs (one set "
                                      f"per slide plus {SLIDES_CSV}): name a folder")
    if not folder.parent.is_dir():
        raise ConfigError("--output", f"{folder.parent} does not exist; name a folder in an existing one")
    check_folder(folder / SLIDES_CSV if folder.is_dir() else folder)      # it (or, made now, its parent) writable
    if (folder / SLIDES_CSV).exists() and not overwrite:
        raise ConfigError("--output", f"{folder / SLIDES_CSV} exists: pass --overwrite to replace the outputs, or "
                                      f"name another folder")


def slide_placement(placement: CanvasPlacement, stride: int, level0_per_pixel: float,
                    mpp: float | None) -> CellPlacement:
    """The map grid of a slide (one map pixel per ``stride`` pixels read, from the slide's origin) as the writers of
    ``pyramid.py``, ``ome.py`` and ``geojson.py`` place maps."""
    width, height = placement.extent
    shape = (-(-height // stride), -(-width // stride))
    return CellPlacement(stride, stride, shape, (height, width), level0_per_pixel, mpp)


def write_slide_map(folder: Path, slide: str, name: str, looked: SlideMap, cells: CellPlacement) -> dict[str, object]:
    """The map's OME-TIFF (channel ``name``, NaN where the canvas does not reach) and the GeoJSON of its regions at or
    above the ``TOP_PERCENTILE``-th percentile of the canvas's cells; what was written."""
    tiff, geojson = map_paths(folder, slide, name)
    pyramid = MapPyramid(looked.values[None].astype(np.float32), cells, tiff)
    threshold = top_threshold(looked.values)
    level0_mpp = None if cells.mpp is None else cells.mpp / cells.level0_per_pixel
    try:
        with replacing(tiff) as tmp:
            write_ome_tiff(tmp, pyramid, class_names=(name,), description={"slide": slide})
        with replacing(geojson) as tmp:
            regions = write_geojson(tmp, pyramid, class_names=(name,), threshold=threshold, mpp=level0_mpp)
    finally:
        pyramid.close()
    return {"map": tiff.name, "regions": regions[name], "threshold": threshold}


def write_slides_csv(path: Path, rows: Sequence[SlideRow], classes: Sequence[str]) -> None:
    """``slides.csv``: slide, patient, label, predicted, prob_<class>... (``evaluate --slide-csv``'s columns but its
    tile count; patient and label empty without a manifest)."""
    with replacing(path) as tmp:
        with tmp.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["slide", "patient", "label", "predicted", *(f"prob_{c}" for c in classes)])
            for row in rows:
                writer.writerow([row.slide, row.patient, row.label, row.predicted(classes),
                                 *(repr(float(p)) for p in row.probabilities)])


@dataclass(frozen=True)
class StoredMap:
    """A map OME-TIFF read back: level 0's values (channels, rows, columns; NaN without data), the channel names and
    µm per map pixel (None: not stored)."""

    values: np.ndarray
    names: tuple[str, ...]
    mpp: float | None


def read_slide_map(path: str | Path) -> StoredMap:
    """Level 0 of a map OME-TIFF (``write_slide_map``'s, or ``infer --output x.ome.tif``'s)."""
    import tifffile

    with tifffile.TiffFile(path) as tif:
        values = np.asarray(tif.series[0].levels[0].asarray(), dtype=np.float32)
        pixels = tifffile.xml2dict(tif.ome_metadata or "<OME/>").get("OME", {}).get("Image", {}).get("Pixels", {})
    channels = pixels.get("Channel", [])
    channels = channels if isinstance(channels, list) else [channels]
    values = values if values.ndim == 3 else values[None]
    names = tuple(str(c.get("Name", f"channel {i}")) for i, c in enumerate(channels)) if len(channels) == \
        values.shape[0] else tuple(f"channel {i}" for i in range(values.shape[0]))
    size = pixels.get("PhysicalSizeX")
    return StoredMap(values, names, None if size is None else float(size))

