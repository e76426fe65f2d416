"""Messages on stderr, each in one write: under ``mpiexec`` stdout and stderr travel apart, so a block written in
pieces (``print`` writes its text, then its newline) lets a JSON line from stdout land inside it."""

from __future__ import annotations

import sys


def to_stderr(text: str) -> None:
    """Write ``text`` and its newline to stderr at once, flushed."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
