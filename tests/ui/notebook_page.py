"""A notebook open in JupyterLab as a user sees it: Run All, wait, read outputs, widgets, images, screenshots."""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any

from .lab import UNTYPED_OUTPUT, WIDGET_VIEW, Lab

RUN_ALL = "li[data-command='runmenu:run-all']"
# Seconds with no cell queued or running (and the kernel idle) that count as done: Run All queues every
# cell at once, so no gap between cells shows an empty queue.
QUIET = 1.0
ERROR_OUTPUT = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.error"]'
BROKEN_WIDGET_TEXTS = ("Error displaying widget", "Loading widget", "HBox(", "VBox(", "Image(value=")


READ_IMAGES = """async els => Promise.all(els.filter(e => getComputedStyle(e).display !== 'none').map(async e => {
    const r = e.getBoundingClientRect();
    try {
        const bytes = new Uint8Array(await (await fetch(e.src)).arrayBuffer());
        let text = '';
        for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
        return [btoa(text), r.width, r.height, e.naturalWidth, e.naturalHeight];
    } catch (err) { return null; }
}))"""


@dataclass(frozen=True)
class ShownImage:
    """An <img> as drawn on screen, with the pixel size of the PNG it shows."""

    src_bytes: bytes
    shown_width: float
    shown_height: float
    natural_width: int
    natural_height: int

    @property
    def aspect_error(self) -> float:
        """Relative difference of the shown aspect ratio from the image's own."""
        shown = self.shown_width / self.shown_height
        natural = self.natural_width / self.natural_height
        return abs(shown / natural - 1)


class NotebookPage:
    """One notebook tab in a Chromium page of a running Lab."""

    def __init__(self, page: Any, lab: Lab, name: str) -> None:
        self.page = page
        self.lab = lab
        self.name = name
        page.goto(lab.lab_url(name), timeout=120_000)
        # slow when loaded: at a load of 14 (a clean-clone suite, stop 74) notebook 05's cells took over 180 s
        page.wait_for_selector(".jp-NotebookPanel .jp-Cell", state="attached", timeout=360_000)
        page.evaluate("() => window.jupyterapp && window.jupyterapp.shell.collapseLeft()")   # the file browser
        self._wait_kernel_idle(180)

    # ------------------------------------------------------------------ running
    def _kernel_status(self) -> str:
        kernels = self.lab.kernels()
        return kernels[0]["execution_state"] if kernels else "none"

    def _wait_kernel_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._kernel_status() != "idle":
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: the kernel did not become idle within {timeout} s")
            time.sleep(0.3)

    def run_all(self, timeout: float = 600) -> float:
        """Run > Run All Cells, then wait until no cell is queued or running for QUIET s; returns seconds taken."""
        start = time.monotonic()
        try:
            self.page.click("li.lm-MenuBar-item:has-text('Run')", timeout=30_000)
            self.page.click(RUN_ALL, timeout=30_000)
        except Exception:   # a loaded machine can leave the menu unclickable for a while: same command, directly
            self.page.keyboard.press("Escape")
            self.page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        self.wait_until_done(timeout, start)
        return time.monotonic() - start

    def wait_until_done(self, timeout: float = 300, start: float | None = None) -> None:
        start = time.monotonic() if start is None else start
        quiet_since = None
        while True:
            busy = self.page.evaluate("""() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]
                                            .some(p => p.textContent.includes('[*]'))""")
            now = time.monotonic()
            if busy:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= QUIET and self._kernel_status() == "idle":
                return
            if now - start > timeout:
                raise TimeoutError(f"{self.name}: cells still running after {timeout} s")
            time.sleep(0.25)

    def run_cell_of(self, text: str, timeout: float = 120) -> None:
        """Select the code cell whose source contains ``text`` and run it (Shift+Enter)."""
        cell = self.code_cell(text)
        cell.locator(".jp-InputArea-editor").click()
        self.page.keyboard.press("Shift+Enter")
        time.sleep(0.5)
        self.wait_until_done(timeout)

    # ------------------------------------------------------------------ reading
    def code_cell(self, text: str) -> Any:
        return self.page.locator(".jp-CodeCell", has=self.page.locator(".jp-InputArea-editor", has_text=text)).first

    def output_texts(self) -> list[str]:
        """Plain text of every output (stream, result, error), in order."""
        return self.page.eval_on_selector_all(".jp-OutputArea-output", "els => els.map(e => e.innerText)")

    def cell_output_text(self, text: str) -> str:
        return self.code_cell(text).locator(".jp-OutputArea").inner_text()

    def errors(self) -> list[str]:
        found = self.page.eval_on_selector_all(ERROR_OUTPUT, "els => els.map(e => e.innerText)")
        found += [t for t in self.output_texts() if "Traceback" in t or "Error" in t.split("\n", 1)[0]]
        return found

    def widget_views(self) -> Any:
        return self.page.locator(WIDGET_VIEW)

    def broken_widgets(self) -> list[str]:
        """Widget outputs that did not render: error/loading placeholders or a plain ``HBox(...)`` repr."""
        bad = []
        for text in self.output_texts():
            bad += [line for line in text.splitlines() if any(line.strip().startswith(b) for b in BROKEN_WIDGET_TEXTS)]
        bad += self.page.eval_on_selector_all(
            UNTYPED_OUTPUT, "els => els.filter(e => !e.querySelector(':scope > .jupyter-widgets'))"
                            "          .map(e => 'not a rendered widget: ' + e.innerText.slice(0, 80))")
        return bad

    def images(self, scope: Any = None) -> list[ShownImage]:
        """Every visible PNG <img> inside ``scope`` (a locator; default the widget views), with sizes as drawn.

        Sizes and bytes are read in one step in the page (a widget's blob URL is revoked when its figure changes).
        """
        scope = scope if scope is not None else self.page.locator(WIDGET_VIEW)
        for _ in range(20):
            rows = scope.locator("img").evaluate_all(READ_IMAGES)
            if all(row is not None for row in rows):
                break
            time.sleep(0.2)                     # a figure was replaced while it was read: read again
        return [ShownImage(base64.b64decode(data), width, height, natural_w, natural_h)
                for data, width, height, natural_w, natural_h in filter(None, rows)
                if width > 0 and height > 0]

    def truncated_labels(self) -> list[str]:
        """Widget labels/descriptions drawn shorter than their text (the text is cut with an ellipsis)."""
        return self.page.eval_on_selector_all(
            f"{WIDGET_VIEW} .widget-label, {WIDGET_VIEW} .widget-label-basic, {WIDGET_VIEW} button",
            """els => els.filter(e => e.offsetParent).filter(e => {
                   const range = document.createRange();          // the text's own width, fractions kept
                   range.selectNodeContents(e);
                   const style = getComputedStyle(e);
                   const room = e.getBoundingClientRect().width - parseFloat(style.paddingLeft)
                                - parseFloat(style.paddingRight);
                   return range.getBoundingClientRect().width > room + 0.5;
               }).map(e => e.innerText)""")

    def screenshot(self, path: str, max_height: int = 12_000) -> None:
        """The whole notebook in one picture: the window is made as tall as the notebook, then restored."""
        height = self.page.evaluate(
            """() => { const nb = document.querySelector('.jp-NotebookPanel-notebook');
                       const scrollers = [nb, ...nb.querySelectorAll('.jp-WindowedPanel-outer')];
                       scrollers.forEach(e => e.scrollTop = 0);
                       return Math.max(...scrollers.map(e => e.scrollHeight)); }""")
        size = self.page.viewport_size
        self.page.set_viewport_size({"width": size["width"], "height": min(int(height) + 200, max_height)})
        time.sleep(1.0)
        self.page.screenshot(path=path)
        self.page.set_viewport_size(size)
        time.sleep(0.5)

    def scroll_to(self, locator: Any) -> None:
        locator.scroll_into_view_if_needed()
        time.sleep(0.2)
