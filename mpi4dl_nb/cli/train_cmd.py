"""``python -m mpi4dl_nb train``: MPI4DL-compatible batch training (any SP/LP/PP/GEMS/DP mix) with checkpoints: the
flags parsed into a TrainJob (its fields are the flags), checked against the data, run (``run/job_run.py``), the
JSON summary printed."""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..console import to_stderr
from ..run.job import TrainJob, TrainPlan
from .job_flags import job_parser, parsed_job
from .parser import CommandParser

if TYPE_CHECKING:
    from ..comm.protocol import Comm
    from ..run.monitor import JobMonitor
    from ..run.summary import TrainSummary

PROG = "python -m mpi4dl_nb train"
DESCRIPTION = ("Train ResNet, AmoebaNet-D or your own CNN (torchvision:, timm:, package.module:callable) with hybrid "
               "spatial/layer/pipeline/GEMS/data parallelism, exactly like one process. Launch with mpiexec -n "
               "<ranks>; 'python -m mpi4dl_nb layout <flags>' tells how many.")


def train_parser() -> CommandParser:
    """The ``train`` parser: a flag for every field of TrainJob."""
    return job_parser(PROG, DESCRIPTION, TrainJob)


def train_plan(args: argparse.Namespace) -> TrainPlan:
    """The job the parsed flags name, checked against its data (ConfigError naming the flag and the fix)."""
    return parsed_job(args, TrainJob, "train").check()


def parsed_plan(argv: Sequence[str] | None) -> TrainPlan:
    """The plan of ``argv``: parsed, checked and laid out before any communication (exit 2 with the reason)."""
    from .setup import launch

    return launch(train_parser(), argv, train_plan)


def train_and_report(plan: TrainPlan, ctx: Comm, monitor: JobMonitor,
                     results: list[TrainSummary] | None = None) -> int:
    """Set up and train, print the JSON summary on rank 0 (kept in ``results`` when given); a refused set-up, a
    divergence or a failed save stops every rank together with one message, as a stop signal does after the step
    and its checkpoint (exit code EXIT_PREEMPTED)."""
    from ..comm.agreement import SetupFailed
    from ..run.divergence import EXIT_NONFINITE, NonFiniteError
    from ..run.job_run import say_once, started_trainer
    from ..run.trainer import EXIT_CHECKPOINT, CheckpointWriteError
    from .setup import exit_refused

    try:
        trainer = started_trainer(plan, ctx, monitor)
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
        if plan.options.verbose:
            to_stderr(summary.report())
        print(summary.to_json(), flush=True)
        if results is not None:
            results.append(summary)
    if trainer.preempted is not None:
        from ..run.preemption import EXIT_PREEMPTED

        say_once(ctx, trainer.preempted.message())
        return EXIT_PREEMPTED
    return 0



def train_main(plan: TrainPlan, results: list[TrainSummary] | None = None) -> int:
    """Start MPI and the job monitor, run the plan; any other failure ends the job with one message. A stop signal
    is marked from the start (during set-up: the run stops after its first step); once pre-empted, the stop signals
    are ignored through the teardown, so repeats end no rank and the exit status stays EXIT_PREEMPTED."""
    from ..run.preemption import EXIT_PREEMPTED, StopSignals

    marked = StopSignals().install()
    code = 1               # an error: the handlers back as they were
    try:
        code = started_job(plan, results)
    finally:
        marked.restore(stopping=code == EXIT_PREEMPTED)
    return code


def started_job(plan: TrainPlan, results: list[TrainSummary] | None) -> int:
    """MPI and the job monitor started, the plan run (``train_main``'s body)."""
    from ..comm.context import init
    from ..run.monitor import EXIT_FAILED, JobMonitor

    ctx = init(backend=plan.options.backend, device=plan.options.device)
    errors_to = plan.held_out.log_dir or plan.checkpoints.directory   # tracebacks: the run's directory, else temp
    monitor = JobMonitor.start(ctx, verbose=plan.options.verbose, log_dir=Path(errors_to) if errors_to else None)
    try:
        code = train_and_report(plan, ctx, monitor, results)
    except SystemExit:
        monitor.close()
        raise
    except BaseException as err:
        monitor.fail(err)        # with several ranks: one message for the job, then abort
        return EXIT_FAILED
    monitor.close()
    return code


def folds_main(plan: TrainPlan) -> int:
    """``--folds K`` without ``--fold``: every fold in turn, then (rank 0) each figure's mean and spread over the
    folds, its JSON last."""
    import json

    from ..run.folds import fold_jobs, fold_report, report_lines

    results: list[TrainSummary] = []
    for fold in fold_jobs(plan):
        code = train_main(fold, results)
        if code != 0:
            return code
    if results:                                  # rank 0
        report = fold_report(results)
        to_stderr("\n".join(report_lines(report)))
        print(json.dumps(report), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m mpi4dl_nb train``."""
    plan = parsed_plan(argv)
    return folds_main(plan) if plan.held_out.every_fold else train_main(plan)
