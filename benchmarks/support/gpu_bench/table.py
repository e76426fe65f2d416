"""One row of ``gpu_bench.sh``'s table from its program's log: verdict, figures, seconds, log file.

``python -m benchmarks.support.gpu_bench.table NAME LOG RC SECONDS LIMIT`` prints the Markdown row.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from .report import last_result

TIMED_OUT = (124, 137)


def table_row(name: str, log: Path, rc: int, seconds: int, limit: int) -> str:
    """The row: PASS when the program exited 0 and said it passed, else FAIL saying why."""
    text = log.read_text(errors="replace") if log.exists() else ""
    result = last_result(text)
    figures = result.figures if result is not None else "no result line (see the log)"
    passed = rc == 0 and result is not None and result.passed
    if rc in TIMED_OUT:
        figures = f"stopped after {limit}s; {figures}"
    elif rc != 0:
        figures = f"exit {rc}; {figures}"
    return f"| {name} | {'PASS' if passed else 'FAIL'} | {figures.replace('|', '/')} | {seconds}s | {log} |"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("log", type=Path)
    parser.add_argument("rc", type=int)
    parser.add_argument("seconds", type=int)
    parser.add_argument("limit", type=int)
    args = parser.parse_args(argv)
    print(table_row(args.name, args.log, args.rc, args.seconds, args.limit))


if __name__ == "__main__":
    main()
