"""``python -m mpi4dl_nb train``: MPI4DL-compatible batch training (any SP/LP/PP/GEMS/DP mix) with checkpoints."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .train_flags import build_parser, check_run_args
from .train_job import train_job

if TYPE_CHECKING:
    from ..comm.protocol import Comm
    from ..run.job import TrainJob
    from ..run.monitor import JobMonitor
    from ..run.summary import TrainSummary

__all__ = ["build_parser", "check_run_args", "main"]


def run_job(job: TrainJob, ctx: Comm, monitor: JobMonitor, results: list[TrainSummary] | None = None) -> int:
    """Set up and train, print the JSON summary on rank 0 (kept in ``results`` when given); a refused set-up, a
    divergence or a failed save stops every rank together with one message."""
    from ..comm.agreement import SetupFailed
    from ..run.divergence import EXIT_NONFINITE, NonFiniteError
    from ..run.job_run import say_once, start
    from ..run.trainer import EXIT_CHECKPOINT, CheckpointWriteError
    from .setup import exit_refused

    try:
        trainer = start(job, ctx, monitor)
    except SetupFailed as err:
        exit_refused(ctx, "train", err)
    try:
        summary = trainer.run()
    except NonFiniteError as err:
        say_once(ctx, f"stopped: {err} The last good checkpoint: {trainer.last_checkpoint or 'none written'}")
        return EXIT_NONFINITE
    except CheckpointWriteError as err:
        say_once(ctx, f"stopped: {err}")
        return EXIT_CHECKPOINT
    if summary is not None:
        if job.options.verbose:
            print(summary.report(), file=sys.stderr, flush=True)
        print(summary.to_json(), flush=True)
        if results is not None:
            results.append(summary)
    return 0


def train_main(job: TrainJob, results: list[TrainSummary] | None = None) -> int:
    """Start MPI and the job monitor, run the job; any other failure ends the job with one message."""
    from ..comm.context import init
    from ..run.monitor import EXIT_FAILED, JobMonitor

    ctx = init(backend=job.options.backend, device=job.options.device)
    errors_to = job.held_out.log_dir or job.checkpoints.directory   # tracebacks: the run's directory, else temp
    monitor = JobMonitor.start(ctx, verbose=job.options.verbose, log_dir=Path(errors_to) if errors_to else None)
    try:
        code = run_job(job, ctx, monitor, results)
    except SystemExit:
        monitor.close()
        raise
    except BaseException as err:
        monitor.fail(err)        # with several ranks: one message for the job, then abort
        return EXIT_FAILED
    monitor.close()
    return code


def parsed_job(argv: Sequence[str] | None) -> TrainJob:
    """The job of ``argv``: parsed, checked and laid out before any communication (exit 2 with the reason)."""
    from .setup import parse_launch

    args: argparse.Namespace
    args, cfg = parse_launch(build_parser(), argv, check_run_args)
    return train_job(args, cfg)


def folds_main(job: TrainJob) -> int:
    """``--folds K`` without ``--fold``: every fold in turn, then (rank 0) each figure's mean and spread over the
    folds, its JSON last."""
    import json

    from ..run.folds import fold_jobs, fold_report, report_lines

    results: list[TrainSummary] = []
    for fold in fold_jobs(job):
        code = train_main(fold, results)
        if code != 0:
            return code
    if results:                                  # rank 0
        report = fold_report(results)
        print("\n".join(report_lines(report)), file=sys.stderr, flush=True)
        print(json.dumps(report), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m mpi4dl_nb train``."""
    job = parsed_job(argv)
    return folds_main(job) if job.held_out.every_fold else train_main(job)
