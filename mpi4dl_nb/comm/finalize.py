"""MPI's finalize with the Python lock released, so the job monitor's thread runs through it and can end the job.

``MPI_Finalize`` waits for every rank of the job (MPICH's process manager holds a barrier in it). mpi4py calls it
holding the interpreter lock, so nothing else in the process runs while it waits, and a host lost at that moment
leaves the job waiting for ever. Called through ctypes (which releases the lock for a foreign call) on the MPI
library this process has loaded, the wait leaves the monitor's thread free to hear that a host is gone, and
``end_job`` to end the job then: ``MPI_Abort`` no longer can (the communicators are gone), so it asks the process
manager itself over its PMI-1 connection (``PMI_FD``, as MPICH's hydra gives each rank), which ends every rank
and the launcher with the code. mpi4py sees the library finalized and does not finalize it again at exit.
"""
from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import NoReturn

MAPS = Path("/proc/self/maps")
ABORT_GRACE_SECONDS = 5.0    # after asking the process manager to end the job: it kills this process meanwhile


class Teardown(Enum):
    """Where this process stands with MPI's finalize (``finalize_releasing_gil``)."""

    BEFORE = "before"
    FINALIZING = "finalizing"
    FINALIZED = "finalized"


_STAGE = {"now": Teardown.BEFORE}


def loaded_mpi_library(maps: str | None = None) -> str | None:
    """The path of the MPI library this process has loaded (``libmpi.so.*``, from ``/proc/self/maps``, or the text
    of ``maps``); None where it cannot be told (not Linux, a static build)."""
    try:
        text = MAPS.read_text() if maps is None else maps
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 6 and Path(fields[-1]).name.startswith("libmpi.so"):
            return fields[-1]
    return None


def finalize_releasing_gil() -> bool:
    """Finalize MPI through ctypes (the interpreter lock released while it waits); False when MPI is not running
    or its library cannot be found (then nothing is done: mpi4py finalizes it at exit as before)."""
    from mpi4py import MPI

    path = loaded_mpi_library()
    if path is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return False
    try:
        finalize = ctypes.CDLL(path).MPI_Finalize
    except (OSError, AttributeError):
        return False
    finalize.restype = ctypes.c_int
    _STAGE["now"] = Teardown.FINALIZING
    try:
        finalize()
    finally:
        _STAGE["now"] = Teardown.FINALIZED
    return True


def end_job(code: int, abort: Callable[[int], None], *, forward_seconds: float = 0.5) -> NoReturn:
    """End the whole job with ``code`` from any thread: ``abort`` (MPI_Abort) before the finalize; during it, the
    process manager's PMI-1 connection; after it (or without one) this process ends with ``code`` and the launcher
    ends the job on it. The output written before gets ``forward_seconds`` to reach the launcher first."""
    if _STAGE["now"] is Teardown.BEFORE:
        abort(code)
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(forward_seconds)
    fd = os.environ.get("PMI_FD", "")
    if _STAGE["now"] is Teardown.FINALIZING and fd.isdigit():
        try:
            os.write(int(fd), f"cmd=abort exitcode={code}\n".encode())
            time.sleep(ABORT_GRACE_SECONDS)
        except OSError:
            pass
    os._exit(code)
