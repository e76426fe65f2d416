"""Many slides in one run (``infer --slides DIR_OR_LIST``, or a cohort manifest ``--cohort FILE.csv`` whose label and
patient join each slide's row so that ``evaluate --cohort`` of the file lines up): the network loaded once, one
output set per slide, a summary table, progress per slide and overall, finished slides skipped on ``--resume``, and
a slide that fails reported and skipped without losing the others (the slides are listed by ``slide_list.py``)."""

from __future__ import annotations

import csv
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ..comm.agreement import SetupFailed
from ..config import ConfigError
from ..console import SetupLines
from .job import CheckedInfer, InferJob
from .outputs.finish import report_columns
from .outputs.kinds import SLIDE_FIELD, OutputSpec
from .pace import slides_text
from .runner import SlideFailed, SlideRunner, settled_job, trained_for
from .slide_list import SlideSource, is_manifest
from .store import work_path
from .summary import InferSummary
from .trained import TrainedNetwork

if TYPE_CHECKING:
    from ..comm.protocol import Comm


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


def finished(specs: Sequence[OutputSpec]) -> bool:
    """Whether a slide's outputs are all there and no partial one waits (a run finished them)."""
    return all(s.path.exists() for s in specs) and not any(work_path(s.path).exists() for s in specs)


def say_on_rank_zero(ctx: Comm, out: TextIO, text: str, shown: bool = True) -> None:
    """One line of ``infer`` on ``out``, written by rank 0 only (and only when ``shown``: progress lines are not
    under ``--no-progress``)."""
    if ctx.rank == 0 and shown:
        out.write(f"mpi4dl_nb infer: {text}\n")
        out.flush()


def run_cohort(checked: CheckedInfer, ctx: Comm, *, stream: TextIO | None = None) -> CohortSummary | None:
    """Every slide of a checked cohort job (``InferJob.check``: slides listed, outputs and the summary table's place
    checked), the network loaded once. Collective; the summary on rank 0, None elsewhere."""
    setup = SetupLines("infer", checked.job.progress and ctx.rank == 0)
    setup.doing(f"loading the checkpoint {checked.checkpoint}")
    trained = trained_for(checked.job, checked.checkpoint, ctx)
    job = settled_job(checked.job, trained, ctx, setup)
    run = CohortRun(job, trained, ctx, stream if stream is not None else sys.stderr, len(checked.slides),
                    is_manifest(job.slide_source))
    results = [run.slide(number, slide) for number, slide in enumerate(checked.slides, start=1)]
    if ctx.rank != 0:
        return None
    table = job.summary_table()
    write_table(table, results)
    return CohortSummary(results, table)


@dataclass
class CohortRun:
    """The slides of a cohort one after the other, each through a SlideRunner with the network loaded once; progress
    on ``out`` (rank 0)."""

    job: InferJob
    trained: TrainedNetwork
    ctx: Comm
    out: TextIO
    total: int
    manifest: bool                 # a manifest names the slides (the table names them as evaluate --cohort does)
    wall: float = field(default_factory=time.perf_counter)

    def say(self, text: str, progress: bool = False) -> None:
        """A line on rank 0; a ``progress`` line (a slide started) only without ``--no-progress``; a slide's outcome
        always."""
        say_on_rank_zero(self.ctx, self.out, text, self.job.progress or not progress)

    def slide(self, number: int, slide: SlideSource) -> SlideResult:
        """One slide: skipped when finished before (``--resume``), else run; a failure reported, not raised."""
        head = f"[slide {number}/{self.total}] {slide.path.name}"
        name = slide.path.stem if self.manifest else slide.path.name
        one = self.job_of(slide)
        if self.job.resume and finished(one.specs()):
            self.say(f"{head}: finished before, skipped")
            return SlideResult(name, "finished before", columns=slide.known())
        self.say(f"{head}: started ({time.perf_counter() - self.wall:.0f} s into the cohort)", progress=True)
        start = time.perf_counter()
        try:
            runner = SlideRunner(one, self.ctx, self.trained)
            try:
                result = runner.run()
            finally:
                runner.close()
        except (SetupFailed, SlideFailed, ConfigError, FileNotFoundError) as err:
            self.say(f"{head}: FAILED, skipped: {err}")
            return SlideResult(name, "failed", time.perf_counter() - start, message=str(err), columns=slide.known())
        return self.done(head, name, slide, result, time.perf_counter() - start, number)

    def job_of(self, slide: SlideSource) -> InferJob:
        """The job of one slide: its outputs the cohort's with ``{slide}`` replaced by its file name."""
        return replace(self.job, slide=str(slide.path), slides=None, cohort=None, summary=None,
                       outputs=tuple(text.replace(SLIDE_FIELD, slide.path.stem) for text in self.job.outputs))

    def done(self, head: str, name: str, slide: SlideSource, result: InferSummary | None, seconds: float,
             number: int) -> SlideResult:
        """A finished slide's row (its per-class figures on rank 0), said on rank 0."""
        if result is None:
            return SlideResult(name, "done", seconds, columns=slide.known())
        rate = result.as_dict().get("megapixels_per_s")
        self.say(f"{head}: done in {seconds:.1f} s, {result.megapixels:.1f} MP "
                 f"({slides_text(number, self.total, time.perf_counter() - self.wall)})")
        return SlideResult(name, "done", seconds, rate if isinstance(rate, float) else None,
                           columns={**slide.known(), **report_columns(result.report, self.trained.classes)})


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
