"""Run a test program under a real ``mpiexec -n N``; fail with every rank's output, kill on timeout."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MPI_PROGRAMS = "tests.mpi"


class MPIRunError(AssertionError):
    """An MPI job failed or timed out; the message carries every rank's output."""


@lru_cache(maxsize=1)
def mpiexec() -> list[str]:
    """The mpiexec beside this interpreter (the venv's mpich wheel), else the one on PATH."""
    local = Path(sys.executable).with_name("mpiexec")
    exe = str(local) if local.exists() else shutil.which("mpiexec")
    if exe is None:
        raise MPIRunError("no mpiexec found: install the 'mpich' wheel into this environment "
                          "(make test does) or put an MPI launcher on PATH")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    if "HYDRA" in version:
        return [exe, "-prepend-rank"]
    if "Open MPI" in version or "OpenRTE" in version:
        return [exe, "--oversubscribe", "--allow-run-as-root", "--tag-output"]
    return [exe]


def mpi_env(nprocs: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for oversubscribed ranks: one thread each, yielding MPI progress."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    if nprocs > (os.cpu_count() or 1):
        env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"
    env.update(extra or {})
    return env


def run_mpi(nprocs: int, script: str, *args: object, timeout: float = 180,
            env: dict[str, str] | None = None, expect_failure: bool = False,
            module: bool = False) -> subprocess.CompletedProcess:
    """Run ``tests/mpi/<script>.py`` as module ``tests.mpi.<script>`` through mpi4py's runner (an
    uncaught exception aborts every rank), or ``-m <script>`` with ``module=True``, on ``nprocs`` ranks.

    Raises MPIRunError with all output if the job exits non-zero (or zero, when
    ``expect_failure``) or runs past ``timeout`` seconds (then the whole job is killed).
    """
    target = ["-m", str(script)] if module else ["-m", "mpi4py", "-m", f"{MPI_PROGRAMS}.{script}"]
    cmd = [*mpiexec(), "-n", str(nprocs), sys.executable, *target, *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=mpi_env(nprocs, env), cwd=REPO, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise MPIRunError(f"timed out after {timeout}s and was killed: {' '.join(cmd)}\n"
                          f"--- output ---\n{out}") from None
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    failed = proc.returncode != 0
    if failed != expect_failure:
        what = "succeeded but was expected to fail" if expect_failure else \
            f"failed with exit code {proc.returncode}"
        raise MPIRunError(f"{' '.join(cmd)} {what}\n--- output of all ranks ---\n{out}")
    return result
