"""Run a program under a real ``mpiexec -n N``: parse its named checks, fail with all ranks' output, kill on timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mpi4dl_nb.comm.launcher import Launcher, rank_environment

from .checks import CheckFailure, CheckReport

REPO = Path(__file__).resolve().parents[2]
MPI_PROGRAMS = "tests.mpi"


class MPIRunError(CheckFailure):
    """An MPI job failed, timed out, or left named checks failed or missing; says which, with all ranks' output."""


class MPIResult(subprocess.CompletedProcess):
    """A finished job: merged output of all ranks, exit code, and the parsed named checks."""

    def __init__(self, args: list[str], returncode: int, stdout: str, checks: CheckReport,
                 timed_out: bool) -> None:
        super().__init__(args, returncode, stdout, "")
        self.checks = checks
        self.timed_out = timed_out


def command(nprocs: int, program: str, *args: object, module: bool = False, launcher: Launcher | None = None,
            hosts: Sequence[str] | None = None) -> list[str]:
    """The ``mpiexec`` command line (mpi4dl_nb/comm/launcher.py: rank-prefixed output, Open MPI's flags) of
    ``tests.mpi.<program>`` through mpi4py's runner (an uncaught exception aborts every rank), or, with
    ``module=True``, ``python -m <program>`` as a user would run it; ``launcher`` (default: this machine's
    mpiexec) and ``hosts`` (one name per slot) place the ranks elsewhere. LaunchForbidden in the fast loop."""
    target = ["-m", program] if module else ["-m", "mpi4py", "-m", f"{MPI_PROGRAMS}.{program}"]
    return (launcher or Launcher.find()).command(nprocs, [sys.executable, *target, *map(str, args)], hosts=hosts)


def start_mpi(nprocs: int, program: str, *args: object, env: dict[str, str] | None = None,
              module: bool = False, **popen: Any) -> subprocess.Popen:
    """Start the job (see ``command``) in a session of its own (``os.killpg`` ends every rank), with the ranks'
    environment (``rank_environment``: one thread each, MPICH yielding beyond the cores, this checkout first
    on PYTHONPATH) plus ``env``; ``popen``: further ``subprocess.Popen`` arguments (its output, by default)."""
    return _popen(command(nprocs, program, *args, module=module), nprocs, env, **popen)


def _popen(cmd: list[str], nprocs: int, env: dict[str, str] | None, hosts: Sequence[str] | None = None,
           **popen: Any) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=rank_environment(nprocs, env, hosts=hosts), cwd=REPO, start_new_session=True,
                            **popen)


def launch_mpi(nprocs: int, program: str, *args: object, timeout: float = 180,
               env: dict[str, str] | None = None, module: bool = False, launcher: Launcher | None = None,
               hosts: Sequence[str] | None = None) -> MPIResult:
    """Run the job to its end (killed after ``timeout`` seconds); never raises for its outcome:
    ``result.checks.job_error`` says how it failed (None: exit code 0). ``launcher``, ``hosts``: see ``command``."""
    cmd = command(nprocs, program, *args, module=module, launcher=launcher, hosts=hosts)
    proc = _popen(cmd, nprocs, env, hosts, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        timed_out, error = False, f"failed with exit code {proc.returncode}" if proc.returncode else None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        timed_out, error = True, f"timed out after {timeout}s and was killed"
    return MPIResult(cmd, proc.returncode, out, CheckReport.parse(out, error, " ".join(cmd)), timed_out)


def run_mpi(nprocs: int, program: str, *args: object, timeout: float = 180,
            env: dict[str, str] | None = None, expect_failure: bool = False,
            module: bool = False, checks: Iterable[str] | None = None) -> MPIResult:
    """Run ``tests/mpi/<program>.py`` (or ``-m <program>`` with ``module=True``) on ``nprocs`` ranks.

    Raises MPIRunError with all output if the job runs past ``timeout`` seconds (then the
    whole job is killed), exits non-zero (zero, when ``expect_failure``), reports a failed
    check on any rank, or leaves one of ``checks`` (names expected) unreported.
    """
    result = launch_mpi(nprocs, program, *args, timeout=timeout, env=env, module=module)
    report = result.checks
    if expect_failure:
        if report.job_error is None:
            raise MPIRunError(f"{report.command} succeeded but was expected to fail\n"
                              f"--- output of all ranks ---\n{result.stdout}")
        if not result.timed_out:
            return result
    try:
        report.require_clean(checks)
    except CheckFailure as failure:
        raise MPIRunError(str(failure)) from None
    return result
