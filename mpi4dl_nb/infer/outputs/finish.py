"""Rank 0 after the last window: every output made from the probability array, streaming, each written to a
temporary file and renamed into place, and the per-class figures of the map (mean probability, area)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..reader import SlideReader
from .geojson import write_geojson
from .kinds import OutputKind, OutputSpec
from .ome import write_ome_tiff
from .overlay import write_overlay
from .placement import CellPlacement
from .pyramid import MapPyramid, write_map_tiff
from .table import write_csv

CLASSIFIER_THRESHOLD = 0.5    # .geojson of a classifier: a cell joins its class's region from this probability
STATS_CELLS = 1 << 14         # cells read at once for the per-class figures


@dataclass(frozen=True)
class OutputRequest:
    """What rank 0 writes once every window is done."""

    specs: tuple[OutputSpec, ...]
    classes: tuple[str, ...]
    placement: CellPlacement
    heat_class: int
    threshold: float | None
    excluded: tuple[int, ...]
    min_area: float
    labels: bool                       # the map is a label map (segmentation): .png draws class colours
    overlay_side: int
    description: Mapping[str, object]


@dataclass(frozen=True)
class OutputReport:
    """Per-class figures of a finished map: mean probability over the cells with data, and the area where each
    class is the most probable (level-0 pixels squared; µm² too when the MPP is known); regions traced."""

    classes: tuple[str, ...]
    mean_probability: tuple[float, ...]
    area_px: tuple[float, ...]
    area_um2: tuple[float, ...] | None
    regions: Mapping[str, int] | None

    def as_dict(self) -> dict[str, object]:
        return {"class_mean_probability": dict(zip(self.classes, self.mean_probability)),
                "class_area_px": dict(zip(self.classes, self.area_px)),
                **({"class_area_um2": dict(zip(self.classes, self.area_um2))} if self.area_um2 is not None else {}),
                **({"regions": dict(self.regions)} if self.regions is not None else {})}


def class_figures(probs: np.ndarray, placement: CellPlacement,
                  tick: Callable[[], None]) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...] | None]:
    """(mean probability, area in level-0 px², area in µm² or None) per class, read strip by strip."""
    classes = probs.shape[0]
    height = placement.cells_of_map(0, placement.map_shape[0], 0)[1]    # cells centred inside the slide
    width = placement.cells_of_map(0, placement.map_shape[1], 1)[1]
    sums = np.zeros(classes)
    counts = np.zeros(classes)
    known = 0
    rows = max(1, STATS_CELLS // max(1, width))
    for r0 in range(0, height, rows):
        block = np.asarray(probs[:, r0:min(r0 + rows, height), :width], dtype=np.float64)
        valid = np.isfinite(block).all(axis=0)
        known += int(valid.sum())
        sums += block[:, valid].sum(axis=1)
        counts += np.bincount(np.argmax(block[:, valid], axis=0), minlength=classes)
        tick()
    cell_area = placement.cell_size ** 2
    mean = tuple(float(v) for v in sums / max(known, 1))
    area = tuple(float(c * cell_area) for c in counts)
    level0_mpp = None if placement.mpp is None else placement.mpp / placement.level0_per_pixel
    return mean, area, None if level0_mpp is None else tuple(a * level0_mpp ** 2 for a in area)


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary name beside ``path``, renamed onto it when the block succeeds (removed when it fails)."""
    tmp = path.with_name(f".{path.name}.writing-{os.getpid()}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_outputs(work: Path, request: OutputRequest, reader: SlideReader, *,
                  tick: Callable[[], None] = lambda: None) -> OutputReport:
    """Every output of ``request`` from the finished probability array ``work`` (.npy); ``work`` ends up as the
    first .npy output, or removed."""
    npy = [s.path for s in request.specs if s.kind is OutputKind.NPY]
    source = npy[0] if npy else work
    if npy:
        os.replace(work, source)
    probs = np.load(source, mmap_mode="r")
    for extra in npy[1:]:
        with replacing(extra) as tmp:
            np.save(tmp, probs)
    mean, area, area_um2 = class_figures(probs, request.placement, tick)
    regions: dict[str, int] | None = None
    drawn = [s for s in request.specs if s.kind not in (OutputKind.NPY, OutputKind.CSV)]
    pyramid = MapPyramid(probs, request.placement, drawn[0].path, tick=tick) if drawn else None
    try:
        for spec in request.specs:
            kind = spec.kind
            assert kind is not None
            if kind is OutputKind.NPY:
                continue
            with replacing(spec.path) as tmp:
                if kind is OutputKind.CSV:
                    write_csv(tmp, probs, request.placement, request.classes, tick=tick)
                    continue
                assert pyramid is not None
                if kind.tiff:
                    write_map_tiff(tmp, pyramid, kind, heat_class=request.heat_class, description=request.description,
                                   class_names=request.classes)
                elif kind is OutputKind.OME:
                    write_ome_tiff(tmp, pyramid, class_names=request.classes, description=request.description)
                elif kind is OutputKind.PNG:
                    write_overlay(tmp, reader.thumbnail(request.overlay_side), pyramid, reader.level0_size,
                                  labels=request.labels, heat_class=request.heat_class, class_names=request.classes)
                elif kind is OutputKind.GEOJSON:
                    level0_mpp = (None if request.placement.mpp is None
                                  else request.placement.mpp / request.placement.level0_per_pixel)
                    regions = write_geojson(tmp, pyramid, class_names=request.classes, threshold=request.threshold,
                                            excluded=request.excluded, min_area=request.min_area, mpp=level0_mpp,
                                            tick=tick)
    finally:
        if pyramid is not None:
            pyramid.close()
        del probs
        if not npy:
            work.unlink(missing_ok=True)
    return OutputReport(request.classes, mean, area, area_um2, regions)


def report_columns(report: OutputReport | None, classes: Sequence[str]) -> dict[str, object]:
    """The per-class figures as flat columns of a cohort's summary table."""
    if report is None:
        return {}
    columns: dict[str, object] = {f"mean P({c})": round(v, 6) for c, v in zip(classes, report.mean_probability)}
    if report.area_um2 is not None:
        columns.update({f"area mm2 ({c})": round(v / 1e6, 6) for c, v in zip(classes, report.area_um2)})
    else:
        columns.update({f"area px2 ({c})": round(v, 1) for c, v in zip(classes, report.area_px)})
    return columns
