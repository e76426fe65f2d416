"""A batch job's end watched: its monitor listens on through MPI's teardown, so a host lost after the summary line
ends the job within the lost-host time, naming the host, instead of leaving the launcher waiting for it for ever.

``mpiexec`` ends when every host has said its ranks ended. MPI's finalize is collective by default (MPICH's
process manager holds a barrier in it): a host lost in it left every other rank waiting there, and a host lost
just after it left the launcher waiting for that host's word although every other rank was gone. So at the end of
``python -m mpi4dl_nb train`` (``exit_watched``) every rank runs its exit hooks, meets the others (an MPI barrier:
every message of the job has arrived), and finalizes MPI locally (MPICH's ``MPIR_CVAR_NO_COLLECTIVE_FINALIZE``,
set for the command before MPI starts); each monitor first outlasts the ranks of other hosts that end before it
(``lost_host.ended_before``: a chain ending with the first monitor), and every rank ends right after its goodbye.
The monitor listens all the while, its thread free even in the finalize (``comm/finalize.py``): a host silent for
the lost-host time is named and the job ended (exit code 6) by a monitor that can still end it. An MPI whose
finalize stays collective is recognised (ranks alive in it for seconds) and waited in, as before.

A notebook engine or a script calling ``dl.train`` keeps its process and its MPI: its monitor says goodbye when
the job ends, as before.
"""
from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn, Protocol

from ..comm.finalize import finalize_releasing_gil, loaded_mpi_library

LOCAL_FINALIZE_COMMAND = "train"      # the command whose end is watched (its monitor lingers)
LOCAL_FINALIZE_VARIABLE = "MPIR_CVAR_NO_COLLECTIVE_FINALIZE"   # MPICH: MPI_Finalize without a barrier


class Lingering(Protocol):
    """What the watch needs of a job monitor (``monitor.JobMonitor``)."""

    def before_finalize(self) -> None: ...     # every rank at the teardown, monitors outlasting others

    def say_goodbye(self) -> None: ...    # the goodbye alone (the process ends right after)

    def end(self) -> None: ...            # the goodbye, its thread stopped


@dataclass
class _Watch:
    """This process's teardown watch: asked for, the monitor lingering, the exit hook registered."""

    enabled: bool = False
    monitor: Lingering | None = None
    registered: bool = False


_WATCH = _Watch()


def exit_watched(command: Callable[[], int], argv: Sequence[str]) -> int:
    """Run the batch command of ``argv`` (``main``: its process ends with it); when it leaves a job monitor
    lingering, end the process through a watched teardown (``end_process``) with the command's exit code, else
    return that code."""
    _WATCH.enabled = True
    if list(argv[:1]) == [LOCAL_FINALIZE_COMMAND]:          # read when MPI starts: set before the command runs
        os.environ.setdefault(LOCAL_FINALIZE_VARIABLE, "1")
    try:
        code = command()
    except SystemExit as stop:
        if _WATCH.monitor is None:
            raise
        code = system_exit_code(stop)
    if _WATCH.monitor is not None:
        end_process(code)
    return code


def system_exit_code(stop: SystemExit) -> int:
    """The process's exit code for ``stop`` (a message instead of a code is printed, and the code is 1)."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr, flush=True)
    return 1


def linger(monitor: Lingering) -> bool:
    """Keep ``monitor`` listening through the teardown; False where the teardown is not watched (the monitor ends
    now). A monitor still lingering from an earlier job of this process (``--folds``) ends first."""
    if not _WATCH.enabled or loaded_mpi_library() is None:    # no finalize with the lock released: not watched
        return False
    previous, _WATCH.monitor = _WATCH.monitor, monitor
    if previous is not None and previous is not monitor:
        previous.end()
    if not _WATCH.registered:    # a process ending otherwise (an exception): MPI finalized with the monitor
        atexit.register(finish)  # listening (mpi4py's own finalize is a C-level hook, run after these)
        _WATCH.registered = True
    return True


def finish() -> None:
    """MPI finalized while the lingering monitor listens, then its goodbye."""
    monitor, _WATCH.monitor = _WATCH.monitor, None
    if monitor is not None:
        finalize_releasing_gil()
        monitor.end()


def end_process(code: int) -> NoReturn:
    """This process's exit hooks, MPI finalized while the lingering monitor listens, its goodbye, and the end with
    ``code`` at once (nothing is left to do: the sooner a rank past the finalize ends, the sooner its host says so)."""
    monitor, _WATCH.monitor = _WATCH.monitor, None
    atexit._run_exitfuncs()       # ``finish`` among them returns at once: the monitor is taken
    if monitor is not None:
        monitor.before_finalize()
        finalize_releasing_gil()
        monitor.say_goodbye()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
