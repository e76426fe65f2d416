"""The ``mpi`` marker's proof (tests/support/mpi_marker.py): a test not marked ``mpi`` can start no MPI job."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mpi4dl_nb.comm.launcher import FORBID_VARIABLE, Launcher, LaunchForbidden, MPIFlavor
from tests.support.mpi_marker import launch_program
from tests.support.mpirun import command


def test_unmarked_tests_run_with_launches_forbidden():
    assert os.environ.get(FORBID_VARIABLE) == "1"
    with pytest.raises(LaunchForbidden, match="mark the test `mpi`"):
        Launcher("/usr/bin/mpiexec", MPIFlavor.MPICH).command(2, ["python", "-c", "pass"])
    with pytest.raises(LaunchForbidden):
        command(2, "harness_probe", "checks")
    child = subprocess.run([sys.executable, "-c", f"import os; print(os.environ['{FORBID_VARIABLE}'])"],
                           capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == "1"      # child processes (kernels, CLI runs) inherit the ban


INNER_SESSION = """
import subprocess

import pytest


@pytest.fixture
def mpirun():
    return None


def test_uses_a_launch_fixture(mpirun):
    pass


def test_swallows_a_refused_launch():
    try:
        subprocess.Popen(["/nowhere/mpiexec", "-n", "2", "true"])
    except Exception:
        pass


def test_starts_no_job():
    pass
"""


def test_launch_fixture_tests_are_marked_and_a_caught_refusal_still_fails(pytester):
    pytester.makepyfile(test_inner=INNER_SESSION)
    selected = pytester.runpytest_inprocess("-p", "tests.support.mpi_marker", "-m", "not mpi", "-q")
    selected.assert_outcomes(passed=1, failed=1, deselected=1)
    selected.stdout.fnmatch_lines(["*test_swallows_a_refused_launch started mpiexec but is not marked `mpi`*"])


def test_launch_programs_are_recognised_by_file_name():
    assert launch_program(["/venv/bin/mpiexec", "-n", "2", "python"]) == "mpiexec"
    assert launch_program("srun -n 3 python", shell=True) == "srun"
    assert launch_program(["ipcluster", "start", "-n", "2"]) == "ipcluster"
    assert launch_program(["/venv/bin/mpiexec", "--version"]) is None     # asking the flavour starts no job
    assert launch_program([sys.executable, "-m", "mpi4dl_nb", "layout"]) is None
    assert launch_program("mpiexec -n 2 python") is None                  # no shell: one program of that name


@pytest.mark.mpi
def test_marked_tests_may_launch():
    assert FORBID_VARIABLE not in os.environ
