"""``make test``: the suite as two pytest runs at once, the tests that start no MPI job beside those that do.

The launching tests (``-m mpi``: MPI jobs, notebook clusters, JupyterLab, Slurm, test hosts) keep both cores
busy; the others (``-m "not mpi"``, proven free of launches by tests/support/mpi_marker.py) are single-process
and mostly single-threaded, so run one after the other they leave a core idle for minutes. Here they run beside
the launching ones: the launching run prints as it goes, the other's output is kept in ``out/test-unit.log``
and printed when both have ended. The exit status is the first non-zero of the two (0 when both pass).

Usage: ``python -m tests.streams [pytest arguments, e.g. -x or -k NAME]``; ``--one-stream`` runs them as one
pytest session (as ``pytest tests`` would).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOG = REPO / "out" / "test-unit.log"
NOTHING_COLLECTED = 5     # pytest's exit status when a -k/-m filter left a stream no test
COMMON = ["-q", "--durations=30", "-p", "no:cacheprovider"]


def pytest_command(marker: str, extra: list[str]) -> list[str]:
    """The pytest command line of one stream: the tests selected by ``marker`` among tests/."""
    return [sys.executable, "-m", "pytest", *COMMON, "-m", marker, *extra, "tests"]


def main(argv: list[str]) -> int:
    if "--one-stream" in argv:
        extra = [a for a in argv if a != "--one-stream"]
        return subprocess.call([sys.executable, "-m", "pytest", *COMMON, *extra, "tests"], cwd=REPO)
    # a SIGTERM (a CI time limit, a killed make) raises here, so neither pytest run outlives this one
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    LOG.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with LOG.open("w") as log:
        unit = subprocess.Popen(pytest_command("not mpi", argv), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            launching = subprocess.call(pytest_command("mpi", argv), cwd=REPO)
        except BaseException:                 # Ctrl-C, SIGTERM: end the other stream too, then stop
            unit.terminate()
            unit.wait()
            raise
        unit_status = unit.wait()
    elapsed = time.monotonic() - started
    print(f"\n---------- the tests that start no MPI job (ran beside the above; {LOG.relative_to(REPO)}) ----------")
    print(LOG.read_text(), end="")
    if launching == unit_status == NOTHING_COLLECTED:
        return NOTHING_COLLECTED
    statuses = [0 if status == NOTHING_COLLECTED else status for status in (launching, unit_status)]
    print(f"\nboth streams ended in {elapsed / 60:.1f} min: launching tests exit {launching}, "
          f"the others exit {unit_status}")
    return next((status for status in statuses if status), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
