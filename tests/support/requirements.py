"""Tests that need system software (a browser, Slurm) or optional packages (torchvision, timm): skipped with how
to enable them, failing under CI=true."""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import pytest


def require_or_skip(missing: list[str], what: str, install: str = "run `make ci-deps` to install") -> None:
    """Skip with one line saying how to enable ``what``; under CI (CI=true) fail instead: CI must run it."""
    if not missing:
        return
    message = f"{what} need {', '.join(missing)}: {install}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message)


MODELS_EXTRA = "pip install -e '.[models]' (`make test` installs it)"


def missing_modules(*names: str) -> list[str]:
    """The Python packages among ``names`` that cannot be imported here."""
    return [name for name in names if importlib.util.find_spec(name) is None]


VOLUMES_EXTRA = "pip install -e '.[volumes]' (`make install` installs it)"


def required_module(name: str, what: str, install: str) -> ModuleType:
    """Module ``name`` for a whole test module (``require_or_skip`` at its import: the test module skipped with how to
    enable it, failing under CI=true)."""
    missing = missing_modules(name)
    if missing and os.environ.get("CI", "").lower() != "true":
        pytest.skip(f"{what} need {name}: {install}", allow_module_level=True)
    require_or_skip(missing, what, install)
    return importlib.import_module(name)
