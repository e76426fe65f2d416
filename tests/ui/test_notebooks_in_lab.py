"""The tutorials in real JupyterLab + Chromium: Run All, every widget renders, no error, then a user's clicks.

Each notebook runs on a scratch copy (Lab's autosave is off by the project's lab config; the test checks the copy
is unchanged after the run). Screenshots land in out/ui/. The live step-through test shuts its kernel down with the
cluster running and checks no engine process is left.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.notebook_output import check_printed_output

from .lab import NOTEBOOKS, REPO, Lab
from .notebook_page import NotebookPage

pytestmark = pytest.mark.ui

OUT = REPO / "out" / "ui"
# Widget views each notebook shows after Run All (03: + the bubble slider exercise; 04: + learning curves;
# 05: + the auto-tune's one-knob sweep).
WIDGETS = {"01": 1, "02": 1, "03": 4, "04": 2, "05": 2, "06": 0, "07": 2, "08": 1, "09": 1, "10": 0, "11": 1,
           "12": 1, "13": 0}
NAMES = {path.name[:2]: path.name for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))}


def screenshot_dir() -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    return OUT


def run_notebook(page, lab: Lab, number: str) -> NotebookPage:
    """Open notebook ``number``, Run All, and check what every notebook must show."""
    name = NAMES[number]
    before = (lab.root / name).read_bytes()
    notebook = NotebookPage(page, lab, name)
    notebook.run_all(timeout=600)
    assert notebook.errors() == [], f"{name}: error output"
    assert notebook.broken_widgets() == [], f"{name}: widgets that did not render"
    assert notebook.widget_views().count() == WIDGETS[number], f"{name}: widget views shown"
    for image in notebook.images():
        assert image.aspect_error < 0.05, f"{name}: a figure drawn at {image.shown_width}x{image.shown_height} " \
                                          f"from a {image.natural_width}x{image.natural_height} PNG"
    assert notebook.truncated_labels() == [], f"{name}: labels cut short"
    notebook.screenshot(str(screenshot_dir() / f"{name[:-6]}.png"))
    # Finding 5: Lab's autosave (interval 1 s in this Lab) must not have written outputs into the notebook.
    assert lab.setting("@jupyterlab/docmanager-extension:plugin")["autosave"] is False
    assert (lab.root / name).read_bytes() == before, f"{name} was saved with outputs"
    return notebook


def widget(notebook: NotebookPage, cell_text: str):
    """The widget view in the output of the code cell whose source contains ``cell_text``."""
    return notebook.code_cell(cell_text).locator(".jp-OutputArea-output > .jupyter-widgets").first


def image_bytes(notebook: NotebookPage, scope) -> list[bytes]:
    return [image.src_bytes for image in notebook.images(scope)]


def wait_for(predicate, timeout: float = 30, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.2)


def set_int(view, label: str, value: int) -> None:
    box = view.locator(f".widget-text:has(label:text-is('{label}')) input")
    box.fill(str(value))
    box.press("Enter")


def fits_screen(notebook: NotebookPage, view) -> None:
    """Controls and figure of a widget fit the notebook area of a 1366x768 screen (no scrolling to see both)."""
    box = view.bounding_box()
    area = notebook.page.locator(".jp-NotebookPanel-notebook").bounding_box()
    assert box["height"] <= area["height"] and box["width"] <= area["width"], \
        f"widget {box['width']:.0f}x{box['height']:.0f} px, notebook area {area['width']:.0f}x{area['height']:.0f}"


# ---------------------------------------------------------------------------------------------------- notebooks
def test_01_config_panel_knobs_and_invalid_input(page, lab):
    notebook = run_notebook(page, lab, "01")
    panel = widget(notebook, "ConfigPanel(model=model")
    notebook.scroll_to(panel)
    fits_screen(notebook, panel)
    world = panel.locator(".widget-html", has_text="world size")
    assert "world size 4" in world.inner_text()                 # the notebook left it at 3 vertical tiles + 1
    images = image_bytes(notebook, panel)
    assert len(images) == 2                                     # rank layout and memory chart

    set_int(panel, "num_spatial_parts", 2)
    wait_for(lambda: "world size 3" in world.inner_text(), what="world size 3")
    wait_for(lambda: (now := image_bytes(notebook, panel)) and len(now) == 2 and now[0] != images[0]
             and now[1] != images[1], what="new layout and memory figures")          # both follow the knob

    panel.locator(".widget-dropdown:has(label:text-is('slice_method')) select").select_option("square")
    status = panel.locator(".widget-html", has_text="perfect square")
    wait_for(lambda: status.count() == 1, what="the error for 2 square parts")
    assert "num_spatial_parts" in status.inner_text()
    # Finding 2: the figures, table and world size of the last valid settings are gone, not left looking current.
    wait_for(lambda: not notebook.images(panel), what="stale figures cleared")
    assert panel.locator(".widget-html", has_text="world size").count() == 0
    assert "rank" not in panel.locator("pre").all_inner_texts().__str__()

    set_int(panel, "num_spatial_parts", 4)
    wait_for(lambda: panel.locator(".widget-html", has_text="world size 5").count() == 1, what="world size 5")
    wait_for(lambda: len(image_bytes(notebook, panel)) == 2, what="figures back for a valid configuration")
    assert notebook.truncated_labels() == []                    # finding 4: "slice_method" not cut to "slice_met..."
    panel.screenshot(path=str(screenshot_dir() / "01_config_panel.png"))


def test_02_halo_viewer_controls_change_the_figure(page, lab):
    notebook = run_notebook(page, lab, "02")
    viewer = widget(notebook, "HaloViewer(image")
    notebook.scroll_to(viewer)
    fits_screen(notebook, viewer)                               # finding 1: controls and figure on one screen
    seen = [image_bytes(notebook, viewer)[0]]
    tile = viewer.locator(".widget-dropdown:has(label:text-is('tile')) select")
    slice_method = viewer.locator(".widget-dropdown:has(label:text-is('slice')) select")
    layer = viewer.locator(".widget-dropdown:has(label:text-is('layer')) select")
    for control, choice in ((tile, "tile 1"), (slice_method, "horizontal"), (layer, {"index": 2})):
        control.select_option(**choice) if isinstance(choice, dict) else control.select_option(label=choice)
        new = wait_for(lambda: (b := image_bytes(notebook, viewer)) and b[0] not in seen and b[0], what="new figure")
        seen.append(new)
    shortcut = next(text for text in layer.locator("option").all_inner_texts() if "shortcut" in text)
    layer.select_option(label=shortcut)
    info = viewer.locator("pre")
    wait_for(lambda: "trims" in info.inner_text(), what="the trim explanation")
    assert not re.search(r"-\d", info.inner_text()), "a negative halo printed without saying it is a trim"
    assert "trim" in viewer.locator(".widget-html").first.inner_text()
    viewer.screenshot(path=str(screenshot_dir() / "02_halo_viewer.png"))


def test_03_step_through_text_timeline_and_glyphs(page, lab):
    notebook = run_notebook(page, lab, "03")
    text = "\n".join(notebook.output_texts())
    assert not re.search(r"</?(b|br|code|pre)\b", text), "raw HTML printed"          # finding 3
    final = notebook.cell_output_text("stepper.run_to_end()")
    assert "step finished on every rank" in final and "waits for peers" not in final  # consistent end state
    assert re.search(r"F stage \d micro_batch \d: compute [\d.]+ ms, waiting for peers [\d.]+ ms", text)
    timeline_cell = notebook.code_cell("TimelineView(events)")
    assert len(notebook.images(timeline_cell)) == 1, "the timeline is shown once"       # finding 4
    labels = page.locator(".jp-OutputArea-output button").all_inner_texts()
    assert any("run to end" in label for label in labels)
    for char in {c for label in labels for c in label if ord(c) > 127}:                 # finding 4: no empty boxes
        fonts = subprocess.run(["fc-list", f":charset={ord(char):x}", "family"], capture_output=True, text=True)
        assert fonts.stdout.strip(), f"no installed font draws {char!r} (U+{ord(char):04X}) on a button"
    dry = widget(notebook, "dry = StepThrough")
    notebook.scroll_to(dry)
    heading = dry.locator(".widget-html").first
    assert "action 3/" in heading.inner_text()
    dry.locator("button", has_text="back").click()
    wait_for(lambda: "action 2/" in heading.inner_text(), what="back to action 2")
    dry.locator("button", has_text="run to end").click()
    wait_for(lambda: re.search(r"action (\d+)/\1 ", heading.inner_text()), what="the last action")


@pytest.mark.parametrize("number", ["04", "05", "06", "07", "08", "09", "10", "11", "12", "13"])
def test_notebook_runs_clean_in_lab(page, lab, number):
    notebook = run_notebook(page, lab, number)
    check_printed_output(number, "\n".join(notebook.output_texts()), lab.tmp)   # 04, 06: as the headless run
    if number == "07":                                   # the 4-rank streamed heat map equals the whole-slide run
        found = re.search(r"max \|streamed - whole slide\| = (\S+)", "\n".join(notebook.output_texts()))
        assert found and float(found.group(1)) < 1e-9


# ------------------------------------------------------------------------------------------ live step-through
LIVE = '''
import torch
import mpi4dl_nb as dl
from mpi4dl_nb.notebook.widgets import ClusterStepAgent, StepThrough

KNOBS = dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical", parts=2)
cluster = dl.cluster.start(n=3)

def setup(knobs, fresh):
    import torch
    from torch import nn
    import mpi4dl_nb as dl
    from mpi4dl_nb.models import build_model
    torch.set_num_threads(1)
    ctx = dl.init()
    torch.manual_seed(0)
    layers = [layer.double() for layer in build_model("resnet", num_layers=11, num_filters=4, num_classes=2)]
    engine = dl.HybridEngine(layers, dl.ParallelConfig(**knobs), ctx, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    generator = torch.Generator().manual_seed(1)
    batch = torch.randn(2, 3, 32, 32, generator=generator, dtype=torch.float64), torch.tensor([0, 1])
    if fresh:
        return repr(engine.train_step(*batch))
    global eng, images, labels
    eng, (images, labels) = engine, batch
    return ctx.rank

cluster.run(setup, KNOBS, False, timeout=120)
agent = ClusterStepAgent(cluster, settle=1.0)
stepper = StepThrough(agent.fetch_schedule(), agent)
stepper.widget
'''
PLAIN = "print('plain step loss', cluster.run(setup, KNOBS, True, timeout=120)[0])"


def write_live_notebook(lab: Lab) -> str:
    import nbformat

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(LIVE.strip()),
                                               nbformat.v4.new_code_cell(PLAIN)])
    notebook.metadata["kernelspec"] = {"name": "mpi4dl-nb", "display_name": "Python (mpi4dl-nb)", "language": "python"}
    nbformat.write(notebook, lab.root / "live_step_through.ipynb")
    return "live_step_through.ipynb"


def test_live_step_through_clicks_reach_the_plain_loss_and_kernel_shutdown_stops_engines(page, lab):
    notebook = NotebookPage(page, lab, write_live_notebook(lab))
    notebook.run_cell_of("cluster = dl.cluster.start", timeout=180)
    assert notebook.errors() == [] and notebook.broken_widgets() == []
    engines = lab.marked_processes()
    assert len([p for p in engines if "ipyparallel" in p[1] or "ipengine" in p[1]]) >= 3
    stepper = widget(notebook, "cluster = dl.cluster.start")
    heading, details = stepper.locator(".widget-html").nth(0), stepper.locator(".widget-html").nth(1)
    forward = stepper.locator("button", has_text="forward")
    for position in (1, 2, 3):
        forward.click()
        wait_for(lambda p=position: f"action {p}/" in heading.inner_text(), timeout=60, what=f"action {position}")
    assert "executed on the cluster" in heading.inner_text()
    stepper.locator("button", has_text="back").click()
    wait_for(lambda: "action 2/" in heading.inner_text(), what="back to action 2")
    forward.click()                                             # re-shows action 3: already executed, not re-run
    wait_for(lambda: "action 3/" in heading.inner_text(), what="action 3 again")
    stepper.locator("button", has_text="run to end").click()
    wait_for(lambda: "step finished on every rank" in details.inner_text(), timeout=120, what="step finished")
    assert "waits for peers" not in details.inner_text()
    stepped = re.search(r"step finished on every rank, loss \[([^\]]+)\]", details.inner_text()).group(1)
    assert "," not in stepped, "ranks disagree on the loss"
    stepper.screenshot(path=str(screenshot_dir() / "03_step_through_live.png"))

    notebook.run_cell_of("plain step loss", timeout=120)
    plain = re.search(r"plain step loss (\S+)", notebook.cell_output_text("plain step loss")).group(1)
    assert float(stepped) == pytest.approx(float(plain), abs=1e-12)

    lab.shutdown_kernels()                                      # the cluster is still running: no cluster.stop()
    wait_for(lambda: not lab.marked_processes(), timeout=30, what="engines to exit after kernel shutdown")
