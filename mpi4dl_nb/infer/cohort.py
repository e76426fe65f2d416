"""Many slides in one run (``infer --slides DIR_OR_LIST``, or a cohort manifest ``--cohort FILE.csv`` whose label and
patient join each slide's row so that ``evaluate --cohort`` of the file lines up): the network loaded once, one
output set per slide, a summary table, progress per slide and overall, finished slides skipped on ``--resume``, and
a slide that fails reported and skipped without losing the others."""

from __future__ import annotations

import csv
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ..comm.agreement import SetupFailed, agreed
from ..config import ConfigError
from ..data.manifest import Cohort, read_cohort
from ..data.pathology import SLIDE_ONLY_EXTENSIONS
from .finish import report_columns
from .outputs import SLIDE_FIELD, OutputSpec, check_folders, check_outputs, summary_folder
from .runner import SlideFailed, SlideRunner
from .settings import InferSettings
from .store import work_path
from .trained import TrainedNetwork, load_network

if TYPE_CHECKING:
    from ..comm.protocol import Comm

SLIDE_SUFFIXES = (*SLIDE_ONLY_EXTENSIONS, ".tif", ".tiff", ".png", ".jpg", ".jpeg")
SUMMARY_NAME = "summary.csv"


def list_slides(source: str | Path) -> list[Path]:
    """``--slides``: a folder (its slide files, sorted; not its sub-folders), a text file with one path a line
    (relative to the file's folder; blank lines and ``#`` comments skipped), one slide file, or slide files
    separated by commas (``A.svs,B.svs``)."""
    path = Path(source).expanduser()
    if not path.exists() and "," in str(source):
        slides = [Path(part.strip()).expanduser() for part in str(source).split(",") if part.strip()]
        missing = [str(s) for s in slides if not s.is_file()]
        if missing:
            raise ConfigError("--slides", f"no such slide file: {', '.join(missing)}")
    elif path.is_file() and path.suffix.lower() in SLIDE_SUFFIXES:
        slides = [path]
    elif path.is_dir():
        slides = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in SLIDE_SUFFIXES)
        if not slides:
            raise ConfigError("--slides", f"{path} holds no slide files ({', '.join(SLIDE_SUFFIXES)})")
    elif path.is_file():
        lines = [line.strip() for line in path.read_text().splitlines()]
        slides = [(path.parent / line).expanduser() for line in lines if line and not line.startswith("#")]
        if not slides:
            raise ConfigError("--slides", f"{path} lists no slides (one path per line)")
    else:
        raise ConfigError("--slides", f"{str(source)!r}: no such folder or list file")
    check_unique_names(slides, "--slides")
    return slides


def check_unique_names(slides: Sequence[Path], knob: str) -> None:
    """Refuse slides sharing a file name without suffix: their outputs (named by ``{slide}``) would collide."""
    stems = [s.stem for s in slides]
    twice = sorted({s for s in stems if stems.count(s) > 1})
    if twice:
        raise ConfigError(knob, f"several slides are named {', '.join(twice)}: outputs are named by {SLIDE_FIELD} "
                                f"(the file name without suffix); rename them or run them apart")


def is_manifest(source: str | Path) -> bool:
    """Whether ``--slides`` names a cohort manifest (a .csv file) rather than a folder or a list of paths."""
    return Path(source).suffix.lower() == ".csv"


def read_manifest(source: str | Path, classes: Sequence[str] | None) -> Cohort:
    """A cohort manifest given to ``infer`` (data/manifest.py; labels among ``classes`` when given); its slide
    names must differ, as outputs are named by them."""
    cohort = read_cohort(source, classes)
    check_unique_names([entry.path for entry in cohort], "--cohort")
    return cohort


@dataclass
class SlideResult:
    """One slide of a cohort: what happened and its figures."""

    slide: str
    status: str                                  # done | finished before (skipped) | failed
    seconds: float = 0.0
    megapixels_per_s: float | None = None
    message: str = ""
    columns: dict[str, object] = field(default_factory=dict)

    def row(self) -> dict[str, object]:
        rate = None if self.megapixels_per_s is None else round(self.megapixels_per_s, 4)
        return {"slide": self.slide, "status": self.status, "seconds": round(self.seconds, 3),
                "megapixels_per_s": rate, **self.columns, "message": self.message}


@dataclass(frozen=True)
class CohortSummary:
    """A cohort's result on rank 0."""

    results: list[SlideResult]
    table: Path

    @property
    def failed(self) -> list[str]:
        return [r.slide for r in self.results if r.status == "failed"]

    def as_dict(self) -> dict[str, object]:
        return {"slides": len(self.results), "done": sum(r.status == "done" for r in self.results),
                "skipped": sum(r.status == "finished before" for r in self.results), "failed": self.failed,
                "summary": str(self.table)}


def check_all(per_slide: Sequence[Sequence[OutputSpec]]) -> None:
    """Without --resume/--overwrite, no slide's output may exist yet (refused before the first slide)."""
    for outputs in per_slide:
        check_outputs(outputs, False)


def finished(specs: Sequence[OutputSpec]) -> bool:
    """Whether a slide's outputs are all there and no partial one waits (a run finished them)."""
    return all(s.path.exists() for s in specs) and not any(work_path(s.path).exists() for s in specs)


def run_cohort(settings: InferSettings, slides_source: str, ctx: Comm, *, summary: str | None = None,
               stream: TextIO | None = None) -> CohortSummary | None:
    """Every slide of ``slides_source`` with ``settings`` (its outputs ``{slide}`` templates). Collective; the
    summary on rank 0, None elsewhere. Bad flags and a network that cannot run are refused before any slide."""
    settings = replace(settings, cohort=True)
    settings.check()
    out = stream if stream is not None else sys.stderr
    manifest = is_manifest(slides_source)
    cohort = agreed(ctx, lambda: read_manifest(slides_source, None)) if manifest else None
    slides = [e.path for e in cohort] if cohort is not None else agreed(ctx, lambda: list_slides(slides_source))
    rows = {e.path: {"patient": e.patient, "label": e.label} for e in cohort} if cohort is not None else {}
    specs = settings.specs()
    per_slide = [[s.for_slide(slide.stem) for s in specs] for slide in slides]
    agreed(ctx, lambda: check_folders([s.path for outputs in per_slide for s in outputs]))
    table = Path(summary) if summary is not None else summary_folder(specs[0]) / SUMMARY_NAME
    if summary is not None and ("{" in str(table.parent) or not table.parent.is_dir()):
        raise ConfigError("--summary", f"{table}: give --summary FILE.csv in an existing folder")
    trained: TrainedNetwork = agreed(ctx, lambda: load_network(
        settings.checkpoint, family=settings.model, dtype=settings.torch_dtype, output_stride=settings.output_stride,
        task=settings.task))
    if cohort is not None:
        agreed(ctx, lambda: read_manifest(slides_source, trained.classes))   # labels among the checkpoint's classes
    if not (settings.resume or settings.overwrite):
        agreed(ctx, lambda: check_all(per_slide))
    results: list[SlideResult] = []
    wall = time.perf_counter()

    def shown(slide: Path) -> str:
        """The slide's name in the table: a manifest's as ``evaluate --cohort`` names it, else the file's."""
        return slide.stem if manifest else slide.name

    def say(text: str) -> None:
        if ctx.rank == 0:
            out.write(f"mpi4dl_nb infer: {text}\n")
            out.flush()

    for number, (slide, outputs) in enumerate(zip(slides, per_slide), start=1):
        head = f"[slide {number}/{len(slides)}] {slide.name}"
        if settings.resume and finished(outputs):
            results.append(SlideResult(shown(slide), "finished before", columns=dict(rows.get(slide, {}))))
            say(f"{head}: finished before, skipped")
            continue
        say(f"{head}: started ({time.perf_counter() - wall:.0f} s into the cohort)")
        one = replace(settings, slide=str(slide), cohort=False,
                      outputs=tuple(text.replace(SLIDE_FIELD, slide.stem) for text in settings.outputs))
        start = time.perf_counter()
        try:
            runner = SlideRunner(one, ctx, trained)
            try:
                result = runner.run()
            finally:
                runner.close()
        except (SetupFailed, SlideFailed, ConfigError, FileNotFoundError) as err:
            results.append(SlideResult(shown(slide), "failed", time.perf_counter() - start, message=str(err),
                                       columns=dict(rows.get(slide, {}))))
            say(f"{head}: FAILED, skipped: {err}")
            continue
        seconds = time.perf_counter() - start
        if result is not None:
            rate = result.as_dict().get("megapixels_per_s")
            results.append(SlideResult(shown(slide), "done", seconds, rate if isinstance(rate, float) else None,
                                       columns={**rows.get(slide, {}),
                                                **report_columns(result.report, trained.classes)}))
            say(f"{head}: done in {seconds:.1f} s, {result.megapixels:.1f} MP "
                f"({len(results)}/{len(slides)} slides, {time.perf_counter() - wall:.0f} s)")
        else:
            results.append(SlideResult(shown(slide), "done", seconds, columns=dict(rows.get(slide, {}))))
    if ctx.rank != 0:
        return None
    write_table(table, results)
    return CohortSummary(results, table)


def write_table(path: Path, results: Sequence[SlideResult]) -> None:
    """The cohort's summary as CSV: one row per slide, the union of every row's columns."""
    rows = [r.row() for r in results]
    names: list[str] = []
    for row in rows:
        names += [k for k in row if k not in names]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=names)
        writer.writeheader()
        writer.writerows(rows)


def print_table(results: Sequence[SlideResult], stream: TextIO) -> None:
    """The summary as an aligned text table (slide, status, seconds, MP/s and the per-class columns)."""
    rows = [{k: v for k, v in r.row().items() if k != "message"} for r in results]
    names: list[str] = []
    for row in rows:
        names += [k for k in row if k not in names]
    cells = [[("" if row.get(n) is None else str(row.get(n))) for n in names] for row in rows]
    widths = [max(len(n), *(len(c[i]) for c in cells)) for i, n in enumerate(names)]
    stream.write("  ".join(n.ljust(w) for n, w in zip(names, widths)) + "\n")
    for c in cells:
        stream.write("  ".join(v.ljust(w) for v, w in zip(c, widths)) + "\n")
