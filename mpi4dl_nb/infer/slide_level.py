"""``infer --slides A,B --output DIR`` (or ``--cohort FILE.csv``) with a whole-slide model: one prediction per slide
from its canvas, placed exactly as training placed it, with progress per slide, the summary table, ``slides.csv`` and
the maps of where an attention or max head looked (``outputs/slide_level.py``)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

import torch

from ..comm.agreement import SetupFailed, agreed
from ..config import ConfigError
from ..console import SetupLines
from ..data.canvas import SlideCanvases
from ..data.pathology import bounds_of
from ..spatial.geometry import TileGrid
from .attention_map import CLASS_MAP_NAME, MAP_NAMES, on_slide
from .cohort import CohortSummary, SlideResult, say_on_rank_zero
from .job import CheckedInfer, InferJob
from .outputs.slide_level import SLIDES_CSV, SlideRow, slide_placement, write_slide_map, write_slides_csv
from .pace import slides_text
from .slide_list import SlideSource
from .whole_slide import CanvasNetwork, SlidePrediction, WholeSlideModel, load_whole_slide

if TYPE_CHECKING:
    from ..comm.protocol import Comm


def canvas_resolution(job: InferJob, trained_mpp: float | None) -> tuple[int, float | None]:
    """(level, µm per pixel) to read canvases at: the flags', else the checkpoint's training MPP."""
    asked = job.target_mpp
    if asked is not None or job.slide_level is not None:
        return job.slide_level or 0, asked
    return 0, trained_mpp


def open_canvas(model: WholeSlideModel, slide: SlideSource, level: int, mpp: float | None,
                source_mpp: float | None) -> SlideCanvases:
    """The slide's canvas as training placed it (``data/canvas.py``), its tissue mask as a channel for tissue-mean."""
    label = model.classes.index(slide.label) if slide.label else 0     # unused by inference; canvases carry one
    return SlideCanvases([slide.path], [label], model.classes, model.image_size,
                         patients=[slide.patient or slide.path.stem], level=level, mpp=mpp, source_mpp=source_mpp,
                         tissue_channel=model.pool.tissue)


def finish_slide(job: InferJob, model: WholeSlideModel, canvases: SlideCanvases,
                 prediction: SlidePrediction) -> dict[str, object]:
    """Rank 0: the slide's maps written (attention/max heads, a slide encoder's class token); its columns of the
    summary table (the canvas's tissue share and the share of the tissue it cut, as training reports them, and the
    maps': the pool's as ``map``, ``regions``, ``threshold``, the class token's with ``class_`` before them)."""
    placement = canvases.placements[0]
    shares: dict[str, object] = {"tissue_share": round(placement.tissue_share, 4),
                                 "cut_share": round(placement.cut_share, 4)}
    maps = [(name, prefix, cells) for name, prefix, cells in ((MAP_NAMES.get(model.pool), "", prediction.cells),
                                                              (CLASS_MAP_NAME, "class_", prediction.class_cells))
            if name is not None and cells is not None]
    for name, prefix, cells in maps:
        looked = on_slide(cells, placement)
        level0_per_pixel = bounds_of(canvases.slide(0)).width / placement.extent[0]
        where = slide_placement(placement, looked.stride, level0_per_pixel, canvases.choices[0].mpp)
        written = write_slide_map(job.output_folder, canvases.names[0], name, looked, where)
        shares.update({f"{prefix}{key}": value for key, value in written.items()})
    return shares


def predict_slide(job: InferJob, network: CanvasNetwork, slide: SlideSource,
                  resolution: tuple[int, float | None], ctx: Comm) -> tuple[SlidePrediction | None, dict[str, object]]:
    """Collective: one slide's canvas through the network, its map written; (prediction, the summary's columns) on
    rank 0, (None, {}) elsewhere. SetupFailed on every rank when any could not place or write it."""
    model = network.model
    canvases = agreed(ctx, lambda: open_canvas(model, slide, *resolution, job.resolution.source_mpp))
    try:
        canvases.use_stain(model.record.stain if job.stain_normalize else None)
        prediction = network.predict(canvases, 0)
        columns = agreed(ctx, lambda: {} if prediction is None else finish_slide(job, model, canvases, prediction))
    finally:
        canvases.close()
    return prediction, columns


def run_slide_level(checked: CheckedInfer, ctx: Comm, *, stream: TextIO | None = None) -> CohortSummary | None:
    """Every slide of a checked slide-level job (``InferJob.check``: slides listed, output folder checked) through
    the whole-slide model of its checkpoint. Collective; the summary on rank 0, None elsewhere. A checkpoint that is
    not a whole-slide model and a grid that does not divide its canvas are refused before the first slide; a slide
    that fails (no tissue, unreadable) is reported and skipped."""
    job = checked.job
    dtype: torch.dtype = job.torch_dtype
    SetupLines("infer", job.progress and ctx.rank == 0).doing(f"loading the whole-slide model {checked.checkpoint}")
    model = agreed(ctx, lambda: load_whole_slide(checked.checkpoint, dtype, check=ctx.rank == 0))
    if ctx.rank == 0:
        job.output_folder.mkdir(exist_ok=True)
    grid = TileGrid.from_slice_method(job.slice_method, job.num_spatial_parts)
    network = agreed(ctx, lambda: CanvasNetwork(model, grid, ctx, dtype))
    run = SlideLevelRun(job, network, ctx, stream if stream is not None else sys.stderr, len(checked.slides),
                        canvas_resolution(job, model.record.data.mpp))
    run.say(f"{len(checked.slides)} slides through {model.description.describe()}, on "
            f"{grid.rows}x{grid.cols} tiles of its {model.image_size} px canvas")
    results = [run.slide(number, slide) for number, slide in enumerate(checked.slides, start=1)]
    if ctx.rank != 0:
        return None
    table = job.output_folder / SLIDES_CSV
    write_slides_csv(table, run.rows, model.classes)
    return CohortSummary(results, table)


@dataclass
class SlideLevelRun:
    """The slides one after the other through the whole-slide model; progress on ``out`` (rank 0), the rows of
    slides.csv."""

    job: InferJob
    network: CanvasNetwork
    ctx: Comm
    out: TextIO
    total: int
    resolution: tuple[int, float | None]       # level and µm per pixel of the canvases
    rows: list[SlideRow] = field(default_factory=list)
    wall: float = field(default_factory=time.perf_counter)

    def say(self, text: str, progress: bool = False) -> None:
        """A line on rank 0; a ``progress`` line (a slide started) only without ``--no-progress``; a slide's outcome
        always."""
        say_on_rank_zero(self.ctx, self.out, text, self.job.progress or not progress)

    def slide(self, number: int, slide: SlideSource) -> SlideResult:
        """One slide's prediction (its row of slides.csv on rank 0); a failure reported, not raised."""
        head = f"[slide {number}/{self.total}] {slide.path.name}"
        start = time.perf_counter()
        self.say(f"{head}: started ({start - self.wall:.0f} s into the run)", progress=True)
        try:
            prediction, columns = predict_slide(self.job, self.network, slide, self.resolution, self.ctx)
        except (SetupFailed, ConfigError) as err:
            self.say(f"{head}: FAILED, skipped: {err}")
            return SlideResult(slide.path.stem, "failed", time.perf_counter() - start, message=str(err),
                               columns=slide.known())
        seconds = time.perf_counter() - start
        if prediction is None:
            return SlideResult(slide.path.stem, "done", seconds, columns=slide.known())
        classes = self.network.model.classes
        row = SlideRow(slide.path.stem, tuple(float(p) for p in prediction.probabilities), slide.patient, slide.label)
        self.rows.append(row)
        probabilities = {f"prob_{c}": round(p, 6) for c, p in zip(classes, row.probabilities)}
        self.say(f"{head}: {row.predicted(classes)} in {seconds:.1f} s "
                 f"({slides_text(number, self.total, time.perf_counter() - self.wall)})")
        return SlideResult(slide.path.stem, "done", seconds, self.network.model.image_size ** 2 / 1e6 / seconds,
                           columns={**slide.known(), "predicted": row.predicted(classes), **probabilities,
                                    **columns})
