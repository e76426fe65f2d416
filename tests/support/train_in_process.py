"""``train`` run in the test's own process: its exit code and what it printed."""

from __future__ import annotations

import pytest

from mpi4dl_nb.cli import train_cmd


def run_train(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``train argv`` in this process: (exit code, stdout, stderr)."""
    try:
        code = train_cmd.main(argv)
    except SystemExit as stop:
        code = int(stop.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err
