"""``infer --slides A,B --output DIR`` (or ``--cohort FILE.csv``) with a whole-slide model: one prediction per slide
from its canvas, placed exactly as training placed it, with progress per slide, the summary table, ``slides.csv`` and
the maps of where an attention or max head looked (``slide_outputs.py``)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import torch

from ..comm.agreement import SetupFailed, agreed
from ..config import ConfigError
from ..data.canvas import SlideCanvases
from ..data.pathology import bounds_of
from ..data.resolution import target_mpp
from ..spatial.geometry import TileGrid
from .attention_map import MAP_NAMES, on_slide
from .cohort import CohortSummary, SlideResult, is_manifest, list_slides, read_manifest
from .settings import DTYPES
from .slide_outputs import (
    SLIDES_CSV,
    SlideRow,
    check_output_folder,
    slide_placement,
    write_slide_map,
    write_slides_csv,
)
from .whole_slide import CanvasNetwork, SlidePrediction, WholeSlideModel, load_whole_slide

if TYPE_CHECKING:
    from ..comm.protocol import Comm


@dataclass(frozen=True)
class SlideLevelSettings:
    """What slide-level inference is asked to do (``infer``'s flags that apply to a whole-slide model)."""

    checkpoint: str
    slides: str                          # --slides (folder, list file, A,B, or manifest) or --cohort FILE.csv
    output: Path                         # --output DIR
    num_spatial_parts: int = 1
    slice_method: str = "square"
    dtype: str = "float32"
    level: int | None = None             # --slide-level (default: the checkpoint's --mpp, else level 0)
    mpp: float | None = None
    magnification: float | None = None
    source_mpp: float | None = None
    overwrite: bool = False
    stain_normalize: bool = True

    def check(self) -> None:
        """Errors in the flags alone, naming the flag and what works."""
        if self.dtype not in DTYPES:
            raise ConfigError("--dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.level is not None and self.level < 0:
            raise ConfigError("--slide-level", f"must be >= 0, got {self.level}")
        target_mpp(self.mpp, self.magnification)
        TileGrid.from_slice_method(self.slice_method, self.num_spatial_parts)

    def resolution(self, trained_mpp: float | None) -> tuple[int, float | None]:
        """(level, µm per pixel) to read canvases at: the flags', else the checkpoint's training MPP."""
        asked = target_mpp(self.mpp, self.magnification)
        if asked is not None or self.level is not None:
            return self.level or 0, asked
        return 0, trained_mpp


@dataclass(frozen=True)
class SlideSource:
    """One slide to predict, with its manifest's label and patient (empty without a manifest)."""

    path: Path
    label: str = ""
    patient: str = ""


def slide_sources(source: str, classes: tuple[str, ...]) -> list[SlideSource]:
    """The slides of ``--slides``/``--cohort`` (a manifest's labels among ``classes``)."""
    if is_manifest(source):
        return [SlideSource(e.path, e.label, e.patient) for e in read_manifest(source, classes)]
    return [SlideSource(path) for path in list_slides(source)]


def open_canvas(model: WholeSlideModel, slide: SlideSource, level: int, mpp: float | None,
                source_mpp: float | None) -> SlideCanvases:
    """The slide's canvas as training placed it (``data/canvas.py``), its tissue mask as a channel for tissue-mean."""
    label = model.classes.index(slide.label) if slide.label else 0     # unused by inference; canvases carry one
    return SlideCanvases([slide.path], [label], model.classes, model.image_size,
                         patients=[slide.patient or slide.path.stem], level=level, mpp=mpp, source_mpp=source_mpp,
                         tissue_channel=model.pool.tissue)


def finish_slide(settings: SlideLevelSettings, model: WholeSlideModel, canvases: SlideCanvases,
                 prediction: SlidePrediction) -> dict[str, object]:
    """Rank 0: the slide's map written (attention/max heads); its columns of the summary table (the canvas's tissue
    share and the share of the tissue it cut, as training reports them, and the map's)."""
    placement = canvases.placements[0]
    shares: dict[str, object] = {"tissue_share": round(placement.tissue_share, 4),
                                 "cut_share": round(placement.cut_share, 4)}
    if prediction.cells is None:
        return shares
    name = MAP_NAMES[model.pool]
    looked = on_slide(prediction.cells, placement)
    level0_per_pixel = bounds_of(canvases.slide(0)).width / placement.extent[0]
    cells = slide_placement(placement, looked.stride, level0_per_pixel, canvases.choices[0].mpp)
    return {**shares, **write_slide_map(settings.output, canvases.names[0], name, looked, cells)}


def predict_slide(settings: SlideLevelSettings, network: CanvasNetwork, slide: SlideSource,
                  resolution: tuple[int, float | None], ctx: Comm) -> tuple[SlidePrediction | None, dict[str, object]]:
    """Collective: one slide's canvas through the network, its map written; (prediction, the summary's columns) on
    rank 0, (None, {}) elsewhere. SetupFailed on every rank when any could not place or write it."""
    model = network.model
    canvases = agreed(ctx, lambda: open_canvas(model, slide, *resolution, settings.source_mpp))
    try:
        canvases.use_stain(model.record.stain if settings.stain_normalize else None)
        prediction = network.predict(canvases, 0)
        columns = agreed(ctx, lambda: {} if prediction is None else finish_slide(settings, model, canvases,
                                                                                   prediction))
    finally:
        canvases.close()
    return prediction, columns


def run_slide_level(settings: SlideLevelSettings, ctx: Comm, *, stream: TextIO | None = None) -> CohortSummary | None:
    """Every slide through the whole-slide model of ``settings.checkpoint``. Collective; the summary on rank 0, None
    elsewhere. Bad flags, a checkpoint that is not a whole-slide model, a grid that does not divide its canvas and an
    output folder in the way are refused before the first slide; a slide that fails (no tissue, unreadable) is
    reported and skipped."""
    settings.check()
    out = stream if stream is not None else sys.stderr
    dtype: torch.dtype = getattr(torch, settings.dtype)
    model = agreed(ctx, lambda: load_whole_slide(settings.checkpoint, dtype, check=ctx.rank == 0))
    slides = agreed(ctx, lambda: slide_sources(settings.slides, model.classes))
    agreed(ctx, lambda: check_output_folder(settings.output, settings.overwrite))
    if ctx.rank == 0:
        settings.output.mkdir(exist_ok=True)
    grid = TileGrid.from_slice_method(settings.slice_method, settings.num_spatial_parts)
    network = agreed(ctx, lambda: CanvasNetwork(model, grid, ctx, dtype))
    level, mpp = settings.resolution(model.record.data.mpp)

    def say(text: str) -> None:
        if ctx.rank == 0:
            out.write(f"mpi4dl_nb infer: {text}\n")
            out.flush()

    say(f"{len(slides)} slides through {model.description.describe()}, on "
        f"{grid.rows}x{grid.cols} tiles of its {model.image_size} px canvas")
    results: list[SlideResult] = []
    rows: list[SlideRow] = []
    wall = time.perf_counter()
    for number, slide in enumerate(slides, start=1):
        head = f"[slide {number}/{len(slides)}] {slide.path.name}"
        known = {"patient": slide.patient, "label": slide.label} if slide.label else {}
        start = time.perf_counter()
        say(f"{head}: started ({start - wall:.0f} s into the run)")
        try:
            prediction, columns = predict_slide(settings, network, slide, (level, mpp), ctx)
        except (SetupFailed, ConfigError) as err:
            results.append(SlideResult(slide.path.stem, "failed", time.perf_counter() - start, message=str(err),
                                       columns=dict(known)))
            say(f"{head}: FAILED, skipped: {err}")
            continue
        seconds = time.perf_counter() - start
        if prediction is not None:
            row = SlideRow(slide.path.stem, tuple(float(p) for p in prediction.probabilities), slide.patient,
                           slide.label)
            rows.append(row)
            probabilities = {f"prob_{c}": round(p, 6) for c, p in zip(model.classes, row.probabilities)}
            results.append(SlideResult(slide.path.stem, "done", seconds, model.image_size ** 2 / 1e6 / seconds,
                                       columns={**known, "predicted": row.predicted(model.classes), **probabilities,
                                                **columns}))
            say(f"{head}: {row.predicted(model.classes)} in {seconds:.1f} s ({number}/{len(slides)} slides, "
                f"{time.perf_counter() - wall:.0f} s)")
    if ctx.rank != 0:
        return None
    table = settings.output / SLIDES_CSV
    write_slides_csv(table, rows, model.classes)
    return CohortSummary(results, table)
