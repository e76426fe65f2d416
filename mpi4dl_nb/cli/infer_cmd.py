"""``python -m mpi4dl_nb infer``: the flags of infer/job.py's InferJob parsed into the job, checked before any rank
talks, run by infer/execute.py (one slide, a cohort, slide-level, a volume); rank 0 prints the outcome once."""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..config import ConfigError
from ..infer.job import CheckedInfer, InferJob
from .flag_names import as_flags
from .job_flags import job_parser, parsed_job
from .parser import CommandParser

if TYPE_CHECKING:
    from ..infer.cohort import CohortSummary
    from ..infer.execute import InferResult

EXIT_SETUP = 2
EXIT_SLIDES_FAILED = 3
DESCRIPTION = ("Apply a checkpoint of 'train' fully convolutionally to a whole slide, window by window, each window "
               "split over --num-spatial-parts ranks (mpiexec -n <parts>); a network without a fully convolutional "
               "form (a transformer) tile by tile (--map-mode auto). The output equals the same network run on "
               "the whole slide in one process. A checkpoint of 'train --whole-slide' instead gives one prediction "
               "per slide from its canvas (--slides A,B or --cohort FILE.csv, --output DIR: slides.csv, and for "
               "attention/max heads a slide-aligned OME-TIFF and GeoJSON of where it looked). Exit status: 0 done, "
               "2 refused before any work, 3 some slides of --slides failed (named on stderr; the others are done).")


def infer_parser() -> CommandParser:
    """The ``infer`` flags, one for each flag field of InferJob."""
    return job_parser("python -m mpi4dl_nb infer", DESCRIPTION, InferJob)


def parse_job(argv: Sequence[str] | None) -> InferJob:
    """The job the command line names (usage errors exit 2 as argparse does; ConfigError for a value refused)."""
    return parsed_job(infer_parser().parse_args(argv), InferJob, "infer")


def say(rank: int, world: int, text: str) -> None:
    prefix = f"[rank {rank}/{world}] " if world > 1 else ""
    print(f"{prefix}mpi4dl_nb infer: {text}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m mpi4dl_nb infer``; the JSON summary is the last line on stdout (rank 0)."""
    from .layout_cmd import launched_world

    rank, size, _ = launched_world()
    try:
        checked = parse_job(argv).check()
    except ConfigError as err:
        if rank == 0:
            say(0, size, f"configuration error: {as_flags(str(err))}")
        return EXIT_SETUP
    try:
        return run(checked, size)
    except SystemExit:
        raise
    except BaseException:
        sys.stderr.write(f"[rank {rank}/{size}] mpi4dl_nb infer failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        if size > 1:
            from mpi4py import MPI

            from ..comm.context import abort_job

            abort_job(MPI.COMM_WORLD, 1)
        return 1


def run(checked: CheckedInfer, size: int) -> int:
    """The checked job on the ranks; rank 0 reports it. Exit code 2 for a set-up refused (or a slide unreadable)."""
    from ..comm.agreement import SetupFailed
    from ..comm.context import init
    from ..infer.execute import run_infer
    from ..infer.runner import SlideFailed

    ctx = init(backend=checked.job.device.backend, device=checked.job.device.device)
    try:
        result = run_infer(checked, ctx)
    except (SetupFailed, ConfigError) as err:
        if ctx.rank == 0:
            say(0, size, f"error: {err}")
        return EXIT_SETUP
    except SlideFailed as err:
        if ctx.rank == 0:
            kept = "the rows done so far are kept: fix the slide and continue with --resume-outputs" if err.kept else \
                "nothing was written: fix the slide and run again"
            say(0, size, f"error: {err}; {kept}")
        return EXIT_SETUP
    return report_outcome(result, size)


def report_outcome(result: InferResult | None, size: int) -> int:
    """Rank 0: the summary table of many slides, a note on a map stopped early, the JSON line; exit code 3 when some
    slides failed."""
    from ..infer.cohort import CohortSummary
    from ..infer.summary import InferSummary

    if result is None:
        return 0
    if isinstance(result, CohortSummary):
        return report_slides(result, size)
    if isinstance(result, InferSummary) and not result.complete:
        say(0, size, f"stopped after output row {result.rows_done} of {result.output_shape[1]}; continue with "
                     f"--resume-outputs")
    print(json.dumps(result.as_dict()), flush=True)
    return 0


def report_slides(summary: CohortSummary, size: int) -> int:
    """Many slides: rank 0 prints the summary table and the JSON line; exit code 3 when some slides failed."""
    from ..infer.cohort import print_table

    print_table(summary.results, sys.stdout)
    print(json.dumps(summary.as_dict()), flush=True)
    if summary.failed:
        say(0, size, f"{len(summary.failed)} of {len(summary.results)} slides failed: {', '.join(summary.failed)} "
            f"(named above; see {summary.table}); the others are done")
        return EXIT_SLIDES_FAILED
    return 0
