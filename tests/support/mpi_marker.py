"""The ``mpi`` marker (a pytest plugin): which tests start MPI jobs, and proof that the others start none.

A test is marked ``mpi`` when it

* uses a launch fixture (``LAUNCH_FIXTURES``, tests/conftest.py), directly or through its own fixtures;
* carries a marker whose tests start jobs (``ui``: JupyterLab runs notebooks on a cluster; ``slurm``;
  ``multihost``: jobs on test hosts);
* or declares it (``@pytest.mark.mpi``, or ``pytestmark = pytest.mark.mpi`` in a module): tests that call
  tests/support/mpirun.py's ``run_mpi``/``launch_mpi``/``start_mpi`` or start a notebook cluster.

So ``pytest -m "not mpi"`` is the fast loop. It proves itself: every other test runs with
``MPI4DL_NB_NO_MPIEXEC=1`` in its environment (children inherit it), where mpi4dl_nb/comm/launcher.py,
which builds every ``mpiexec`` command line (the suite's, the notebook cluster's), raises LaunchForbidden;
and this process refuses to start an MPI launcher by any other road (``LAUNCH_PROGRAMS``), failing the test
even if it caught the error. A test that launches without its declaration fails, naming the fix.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from mpi4dl_nb.comm.launcher import FORBID_VARIABLE, LaunchForbidden

MARKER = "mpi"
#: Fixtures that launch ``mpiexec`` (tests/conftest.py).
LAUNCH_FIXTURES = frozenset({"mpirun", "mpi_checks", "shared_launch"})
#: Markers whose tests start MPI jobs: browser tests run notebooks that start a cluster; Slurm tests submit jobs;
#: multihost tests run jobs on test hosts.
LAUNCHING_MARKERS = ("ui", "slurm", "multihost")
#: Programs that start MPI jobs or engine sets; refused in the fast loop (a version query is allowed).
LAUNCH_PROGRAMS = frozenset({"mpiexec", "mpirun", "mpiexec.hydra", "orterun", "srun", "sbatch", "salloc",
                             "ipcluster"})
REFUSED = pytest.StashKey[list[str]]()


def launches(item: pytest.Item) -> bool:
    """Whether ``item`` starts MPI jobs, by the rules of this module's docstring."""
    names = set(getattr(item, "fixturenames", ()))
    return bool(names & LAUNCH_FIXTURES) or any(item.get_closest_marker(m) for m in (MARKER, *LAUNCHING_MARKERS))


def launch_program(args: Any, shell: bool = False) -> str | None:
    """The MPI launcher a ``subprocess.Popen(args)`` would start (its file name), None for anything else."""
    if isinstance(args, (str, bytes, os.PathLike)):
        text = os.fsdecode(args)
        argv: Sequence[str] = shlex.split(text) if shell else [text]
    else:
        argv = [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in args]
    if not argv or list(argv[1:]) == ["--version"]:
        return None
    name = os.path.basename(argv[0])
    return name if name in LAUNCH_PROGRAMS else None


@contextmanager
def launches_forbidden(item: pytest.Item) -> Iterator[None]:
    """``FORBID_VARIABLE`` set and MPI launchers refused (recorded on the item) while ``item`` runs."""
    refused = item.stash.setdefault(REFUSED, [])
    original = subprocess.Popen.__init__

    def guarded_init(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        program = launch_program(args, kwargs.get("shell", False))
        if program is not None:
            refused.append(program)
            raise LaunchForbidden(forbidden_message(item, program))
        original(self, args, *rest, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FORBID_VARIABLE, "1")
        patch.setattr(subprocess.Popen, "__init__", guarded_init)
        yield


def forbidden_message(item: pytest.Item, program: str) -> str:
    return (f"{item.nodeid} started {program} but is not marked `{MARKER}`: mark it `@pytest.mark.{MARKER}` (or use a "
            f"launch fixture: {', '.join(sorted(LAUNCH_FIXTURES))}); `pytest -m \"not {MARKER}\"` starts no MPI job")


@pytest.hookimpl(tryfirst=True)     # before -m selects by it
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if launches(item) and not item.get_closest_marker(MARKER):
            item.add_marker(MARKER)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """Tests not marked ``mpi`` run (set-up and tear-down included) where no MPI job may start."""
    if item.get_closest_marker(MARKER):
        return (yield)
    with launches_forbidden(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    """A refused launch fails the test even when the test caught the error."""
    result = yield
    refused = item.stash.get(REFUSED, [])
    if refused:
        raise LaunchForbidden(forbidden_message(item, refused[0]))
    return result
