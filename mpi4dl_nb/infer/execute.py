"""A checked InferJob run on the ranks, each kind by its runner: one slide (runner.py), a cohort (cohort.py),
slide-level inference (slide_level.py), a volume (volume_api.py); the summary on rank 0."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .cohort import CohortSummary, run_cohort
from .job import CheckedInfer, InferKind
from .runner import SlideRunner
from .slide_level import run_slide_level
from .summary import InferSummary
from .volume import VolumeSummary
from .volume_api import run_volume_job

if TYPE_CHECKING:
    from ..comm.protocol import Comm

InferResult = InferSummary | CohortSummary | VolumeSummary


def run_slide(checked: CheckedInfer, ctx: Comm) -> InferSummary | None:
    """One slide's maps, window by window, from the checked checkpoint file."""
    runner = SlideRunner(checked.job, ctx, checkpoint=checked.checkpoint)
    try:
        return runner.run()
    finally:
        runner.close()


def run_infer(checked: CheckedInfer, ctx: Comm) -> InferResult | None:
    """Collective: the checked job's kind through its runner; its summary on rank 0, None elsewhere. ConfigError or
    SetupFailed (every rank) for a set-up refused; SlideFailed when one slide cannot be read during the run."""
    if checked.kind is InferKind.VOLUME:
        return run_volume_job(checked, ctx)
    if checked.kind is InferKind.SLIDE_LEVEL:
        return run_slide_level(checked, ctx)
    if checked.kind is InferKind.COHORT:
        return run_cohort(checked, ctx)
    return run_slide(checked, ctx)
