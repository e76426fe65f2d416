"""``python -m mpi4dl_nb evaluate``: a trained checkpoint on held-out data, with any rank layout: the flags parsed into
an EvaluateJob (its fields are the flags), checked, run (``run/evaluate_run.py``), one JSON line printed."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..run.evaluate_job import EvaluateJob, EvaluatePlan
from .job_flags import job_parser, parsed_job
from .parser import CommandParser

PROG = "python -m mpi4dl_nb evaluate"
DESCRIPTION = ("Evaluate a checkpoint written by 'train --checkpoint-dir' on its held-out images (the training run's "
               "--val-fraction split, or --val-datapath) with any rank layout; prints one JSON line of metrics. "
               "Model, image size, data and split default to the checkpoint's.")


def evaluate_parser() -> CommandParser:
    """The ``evaluate`` parser: a flag for every field of EvaluateJob."""
    return job_parser(PROG, DESCRIPTION, EvaluateJob)


def evaluate_plan(args: argparse.Namespace) -> EvaluatePlan:
    """The job the parsed flags name, checked (the checkpoint file found, the cohort read)."""
    return parsed_job(args, EvaluateJob, "evaluate").check()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m mpi4dl_nb evaluate``: refused set-ups exit 2 on every rank with one message."""
    from ..comm.agreement import SetupFailed
    from ..comm.context import init
    from ..run.evaluate_run import run_evaluation
    from .setup import exit_refused, launch

    plan = launch(evaluate_parser(), argv, evaluate_plan)
    ctx = init(backend=plan.job.placement.backend, device=plan.job.placement.device)
    try:
        summary = run_evaluation(plan, ctx)
    except SetupFailed as err:
        exit_refused(ctx, "evaluate", err)
    if summary is not None:
        if summary.levels:
            print(summary.table(), file=sys.stderr, flush=True)
        print(summary.to_json(), flush=True)
    return 0
