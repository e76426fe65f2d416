"""Named checks in MPI test programs: each rank prints one line per check, the launcher parses them.

In a program under ``mpiexec`` (see tests/mpi/)::

    def main(check: Checks) -> None:
        ctx = dl.init()
        with check("lp2") as result:          # a failure is recorded, the program goes on
            ...                               # assertions
            result.detail = "max rel err 1e-15"

    if __name__ == "__main__":
        run_checks(main)                      # exits non-zero when any check failed

Every rank prints ``@@CHECK {"name": ..., "rank": ..., "passed": ..., "detail": ...}`` per
check it runs (the failing rank also prints the traceback), waits for the other ranks, and
exits 1 if one of its checks failed. A failed check may leave the ranks out of step (one
skipped a message the others wait for): a rank with a failure aborts the whole job when it
completes no further check for ``grace`` seconds, so the report comes well before the
launcher's timeout. ``tests.support.mpirun`` parses the lines into a ``CheckReport``.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

MARK = "@@CHECK "
RANK_PREFIX = re.compile(r"\[\d+\] ")   # MPICH's -prepend-rank, also before each piece of a line


class CheckFailure(AssertionError):
    """Named checks of an MPI job failed or never reported; the message lists each with its rank."""


@dataclass(frozen=True)
class CheckResult:
    """What one rank reported for one named check."""

    name: str
    rank: int
    passed: bool
    detail: str = ""

    def __str__(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'} [rank {self.rank}] {self.name}: {self.detail}"


@dataclass
class CheckReport:
    """Every check line of one job's output, and how the job ended (``job_error`` None: exit code 0)."""

    results: list[CheckResult]
    job_error: str | None = None
    output: str = ""
    command: str = ""

    @classmethod
    def parse(cls, output: str, job_error: str | None = None, command: str = "") -> CheckReport:
        results, decoder = [], json.JSONDecoder()
        for found in re.finditer(re.escape(MARK), output):   # launchers may join ranks' lines
            rest = output[found.end():].split("\n", 1)[0]
            try:
                record, _ = decoder.raw_decode(rest)
            except json.JSONDecodeError:   # a launcher's rank prefix inside the line
                record, _ = decoder.raw_decode(RANK_PREFIX.sub("", rest))
            results.append(CheckResult(**record))
        return cls(results, job_error, output, command)

    def names(self) -> set[str]:
        return {r.name for r in self.results}

    def failures(self, names: Iterable[str] | None = None) -> list[CheckResult]:
        wanted = None if names is None else set(names)
        return [r for r in self.results if not r.passed and (wanted is None or r.name in wanted)]

    def missing(self, names: Iterable[str] | None) -> list[str]:
        return [n for n in names if n not in self.names()] if names is not None else []

    def require(self, names: Iterable[str] | None = None) -> None:
        """Raise CheckFailure unless each of ``names`` (None: every reported check) passed on every
        rank that ran it and was reported by at least one rank.

        A job that failed without any failed check (crash, abort, timeout) fails every
        requirement: nothing explains it.
        """
        names = None if names is None else list(names)
        unexplained = self.job_error is not None and not self.failures()
        self._raise_if(self.failures(names), self.missing(names), unexplained, names)

    def require_clean(self, names: Iterable[str] | None = None) -> None:
        """Raise CheckFailure if any check failed, one of ``names`` is missing, or the job failed."""
        names = None if names is None else list(names)
        self._raise_if(self.failures(), self.missing(names), self.job_error is not None, names)

    def _raise_if(self, failed: list[CheckResult], missing: list[str], job_failed: bool,
                  names: list[str] | None) -> None:
        if not (failed or missing or job_failed):
            return
        lines = []
        if failed or missing or names or self.results:
            expected = len(names) if names is not None else len(self.names())
            lines.append(f"{len(failed)} failed and {len(missing)} missing of {expected} named "
                         f"checks" + (f" in {self.command}" if self.command else ""))
            lines += [f"  {r}" for r in failed]
            lines += [f"  MISSING {n}: no rank reported it" for n in missing]
        if self.job_error is not None:
            lines.append(f"job: {self.command + ' ' if self.command else ''}{self.job_error}")
        lines.append(f"--- output of all ranks ---\n{self.output}")
        raise CheckFailure("\n".join(lines))


@dataclass
class Outcome:
    """Yielded by a check: set ``detail`` to say what passed (shown in the report)."""

    detail: str = ""


def describe(error: BaseException) -> str:
    """Type, message and the innermost frame (file:line and source) of an exception."""
    frames = traceback.extract_tb(error.__traceback__)
    where = ""
    if frames:
        frame = frames[-1]
        where = f" at {Path(frame.filename).name}:{frame.lineno}: {(frame.line or '').strip()}"
    message = str(error)
    return f"{type(error).__name__}{': ' + message if message else ''}{where}"


@dataclass
class Checks:
    """``check(name)`` context manager of one rank; count of failures; the stall watchdog."""

    grace: float = 120.0
    failed: int = 0
    prefix: str = ""        # put before every name (the job's label in a shared launch)
    rank: int = field(init=False)
    _watchdog: threading.Timer | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        from mpi4py import MPI

        self._comm = MPI.COMM_WORLD
        self.rank = self._comm.rank

    @contextmanager
    def __call__(self, name: str) -> Iterator[Outcome]:
        outcome = Outcome()
        start = time.perf_counter()
        try:
            yield outcome
        except Exception as error:
            self.failed += 1
            self._emit(name, False, describe(error))
            traceback.print_exc(file=sys.stderr)
            sys.stderr.flush()
        else:
            seconds = f"{time.perf_counter() - start:.2f}s"
            self._emit(name, True, f"{outcome.detail}, {seconds}" if outcome.detail else seconds)
        if self.failed:
            self._arm_watchdog(name)

    def _emit(self, name: str, passed: bool, detail: str) -> None:
        record = json.dumps({"name": self.prefix + name, "rank": self.rank, "passed": passed, "detail": detail})
        sys.stdout.write(f"{MARK}{record}\n")   # one write: lines of ranks stay whole
        sys.stdout.flush()

    def _arm_watchdog(self, last: str) -> None:
        """(Re)start the timer that aborts the job when no check completes for ``grace`` seconds."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watchdog = threading.Timer(self.grace, self._abort, args=(last,))
        self._watchdog.daemon = True
        self._watchdog.start()

    def _abort(self, last: str) -> None:
        print(f"rank {self.rank}: no check completed for {self.grace:.0f}s after a failure (last: "
              f"{last!r}); the ranks are out of step, aborting the job", file=sys.stderr, flush=True)
        from mpi4dl_nb.comm.context import abort_job

        abort_job(self._comm, 1)     # the launcher forwards the line first

    def finish(self) -> NoReturn:
        """Wait for every rank, then exit 1 if a check of this rank failed (0 otherwise)."""
        self._comm.Barrier()
        sys.exit(1 if self.failed else 0)


def run_checks(main: Callable[[Checks], Any], grace: float = 120.0) -> NoReturn:
    """Run ``main(check)`` on this rank and exit with the checks' status."""
    check = Checks(grace)
    main(check)
    check.finish()
