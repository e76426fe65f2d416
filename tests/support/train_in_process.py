"""A command (``train`` and others) run in the test's own process: its exit code and what it printed."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mpi4dl_nb.cli import train_cmd


def run_train(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``train argv`` in this process: (exit code, stdout, stderr)."""
    return run_command(train_cmd.main, argv, capsys)


def run_command(main: Callable[[list[str]], int], argv: list[str],
                capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """A command's ``main(argv)`` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = int(stop.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err
