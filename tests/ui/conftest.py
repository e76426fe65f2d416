"""Browser-test fixtures: one JupyterLab and one Chromium per session; skipped (failing under CI=true) without them."""

from __future__ import annotations

import pytest

from tests.support.requirements import require_or_skip

from .lab import CHROMIUM_ARGS, VIEWPORT, chromium_binary, missing_requirements, running_lab


@pytest.fixture(scope="session")
def lab():
    require_or_skip(missing_requirements(), "the browser tests")
    with running_lab() as server:
        yield server


@pytest.fixture(scope="session")
def browser(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=chromium_binary(), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser, lab):
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    page.set_default_timeout(60_000)
    try:
        yield page
    finally:
        context.close()
        lab.shutdown_kernels()
