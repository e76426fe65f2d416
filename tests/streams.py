"""``make test``: the suite as two pytest runs at once, the tests that start no MPI job beside those that do.

The launching tests (``-m mpi``: MPI jobs, notebook clusters, JupyterLab, Slurm, test hosts) keep both cores
busy; the others (``-m "not mpi"``, proven free of launches by tests/support/mpi_marker.py) are single-process
and mostly single-threaded, so run one after the other they leave a core idle for minutes. Here they run beside
the launching ones: the launching run prints as it goes, the other's output is kept in ``out/test-unit.log``
and printed when both have ended. mypy runs beside them (``out/mypy.log``, printed last). The exit status is the
first non-zero of the four runs (0 when all pass).

The launching tests of ``SECOND`` run in the second stream once its unit tests have ended, so the two streams
end at about the same time (clean clone at 326ea38: launching 24.4 min, the other 7.5 min + 18.0 min of these,
the test hosts' 2.4 of them, since moved to the launching stream); the tests marked ``alone`` run after both, the
machine to themselves (``tune``'s predictions against its measurements, about half a minute). The test hosts
spend most of their time waiting
(for hosts to come up, for heartbeats to stop and a watchdog to fire); the JupyterLab tests (~15 min beside the
launching stream, thirteen notebooks) drive a browser and one kernel at a time. The Slurm tests (~1.2 min, mostly a
batch queue's waits) run in the launching stream since stop 59. The headless
notebook runs go with the Lab ones: tests/conftest.py skips a headless run that the same session runs in Lab.

Usage: ``python -m tests.streams [pytest arguments, e.g. -x or -k NAME]``; ``--one-stream`` runs them as one
pytest session (as ``pytest tests`` would); ``--second-stream`` runs the second stream alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOG = REPO / "out" / "test-unit.log"
# mypy (``make lint``'s type check, ~35 CPU-s cold) runs beside the two streams instead of before them: on two cores it
# left one idle for most of a minute; ``make test`` runs ruff and the Any budget first (under a second)
TYPE_CHECK = [sys.executable, "-m", "mypy"]
TYPE_LOG = REPO / "out" / "mypy.log"
NOTHING_COLLECTED = 5     # pytest's exit status when a -k/-m filter left a stream no test
COMMON = ["-q", "--durations=30", "-p", "no:cacheprovider"]
# launching tests run in the second stream, after its unit tests (one pytest session: the Lab and headless
# notebook runs must be collected together)
SECOND = ("tests/ui", "tests/notebook/test_notebooks.py")
# the tests marked ``alone`` (a prediction against what the machine then measures) run after both streams, the
# machine to themselves: beside the other stream two ranks get a part of their cores, which no prediction assumes
LAUNCHING = "mpi and not alone"


def pytest_command(marker: str, extra: list[str], paths: tuple[str, ...] = ("tests",),
                   ignore: tuple[str, ...] = ()) -> list[str]:
    """The pytest command line of one run: the tests selected by ``marker`` among ``paths``, but ``ignore``."""
    return [sys.executable, "-m", "pytest", *COMMON, "-m", marker, *(f"--ignore={path}" for path in ignore),
            *extra, *paths]


def combined(statuses: list[int]) -> int:
    """The exit status of runs: the first non-zero, a run that a filter left no test counting as passed
    (NOTHING_COLLECTED when every run was left none)."""
    if all(status == NOTHING_COLLECTED for status in statuses):
        return NOTHING_COLLECTED
    return next((status for status in statuses if status not in (0, NOTHING_COLLECTED)), 0)


def call(command: list[str]) -> int:
    """Run ``command`` to its end; if this process is stopped meanwhile (Ctrl-C, SIGTERM), end it first."""
    proc = subprocess.Popen(command, cwd=REPO)
    try:
        return proc.wait()
    except BaseException:
        proc.terminate()
        proc.wait()
        raise


def second_stream(argv: list[str]) -> int:
    """The tests that start no MPI job, then the launching tests of ``SECOND``."""
    return combined([call(pytest_command("not mpi", argv)), call(pytest_command(LAUNCHING, argv, SECOND))])


def main(argv: list[str]) -> int:
    # the suite starts hundreds of interpreters (MPI ranks, commands, notebook engines), each importing the package
    # and the tests: with their bytecode cached (``__pycache__``, ignored by git) an interpreter loads them instead
    # of compiling them again (~0.4 CPU-s each here, and pytest's collection 15 -> 8 CPU-s), so a
    # PYTHONDONTWRITEBYTECODE inherited from the shell (some containers set it) is dropped for the suite's processes
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    if "--one-stream" in argv:
        extra = [a for a in argv if a != "--one-stream"]
        return subprocess.call([sys.executable, "-m", "pytest", *COMMON, *extra, "tests"], cwd=REPO)
    # a SIGTERM (a CI time limit, a killed make) raises here, so no pytest run outlives this one
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if "--second-stream" in argv:
        return second_stream([a for a in argv if a != "--second-stream"])
    LOG.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with LOG.open("w") as log, TYPE_LOG.open("w") as types:
        typing = subprocess.Popen(TYPE_CHECK, cwd=REPO, stdout=types, stderr=subprocess.STDOUT)
        unit = subprocess.Popen([sys.executable, "-m", "tests.streams", "--second-stream", *argv], cwd=REPO,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            launching = subprocess.call(pytest_command(LAUNCHING, argv, ignore=SECOND), cwd=REPO)
        except BaseException:                 # Ctrl-C, SIGTERM: end the other stream and mypy too, then stop
            for other in (unit, typing):
                other.terminate()
                other.wait()
            raise
        unit_status = unit.wait()
        typing_status = typing.wait()
    elapsed = time.monotonic() - started
    print(f"\n---------- the tests that start no MPI job, then {', '.join(SECOND)} (ran beside the above; "
          f"{LOG.relative_to(REPO)}) ----------")
    print(LOG.read_text(), end="")
    print(f"\n---------- mypy (ran beside both; {TYPE_LOG.relative_to(REPO)}) ----------")
    print(TYPE_LOG.read_text(), end="")
    print(f"\nboth streams ended in {elapsed / 60:.1f} min: launching tests exit {launching}, "
          f"the others exit {unit_status}, mypy exit {typing_status}")
    print("\n---------- the tests that compare a prediction with what the machine measures (-m alone), "
          "the machine to themselves ----------", flush=True)
    alone = call(pytest_command("alone", argv))
    return combined([launching, unit_status, typing_status, alone])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
