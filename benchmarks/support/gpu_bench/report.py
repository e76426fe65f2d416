"""How a row's program hands its verdict and figures to ``gpu_bench.sh``: one marked line of JSON on rank 0."""

from __future__ import annotations

import json
from dataclasses import dataclass

MARK = "gpu_bench result: "


@dataclass(frozen=True)
class Result:
    """A row's verdict and its figures (one line of text for the table)."""

    passed: bool
    figures: str

    def line(self) -> str:
        """The marked line the script looks for in the row's log."""
        return MARK + json.dumps({"passed": self.passed, "figures": self.figures})


def report(passed: bool, figures: str) -> None:
    """Print the row's result line (rank 0 calls it once, last)."""
    print(Result(passed, figures).line(), flush=True)


def last_result(log: str) -> Result | None:
    """The last result line in a row's log text (None: the program printed none)."""
    for line in reversed(log.splitlines()):
        start = line.find(MARK)
        if start >= 0:
            try:
                found = json.loads(line[start + len(MARK):])
                return Result(bool(found["passed"]), str(found["figures"]))
            except (ValueError, KeyError, TypeError):
                return None
    return None
