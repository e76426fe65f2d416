"""Tests that need system software (a browser, Slurm): skipped with how to enable them, failing under CI=true."""

from __future__ import annotations

import os

import pytest


def require_or_skip(missing: list[str], what: str) -> None:
    """Skip with one line saying how to enable ``what``; under CI (CI=true) fail instead: CI must run it."""
    if not missing:
        return
    message = f"{what} need {', '.join(missing)}: run `make ci-deps` to install"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message)
