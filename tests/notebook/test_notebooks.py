"""Every tutorial notebook is the build of its jupytext source and runs top to bottom, headless, against a real
local MPI cluster; the git filter and JupyterLab saves cannot put outputs or churn into git."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from mpi4dl_nb.notebook import tutorials
from tests.support.notebook_output import check_printed_output

NOTEBOOKS = tutorials.DIRECTORY          # the checkout's notebooks/, wherever this test file lives
ALL = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
SOURCES = tutorials.sources(NOTEBOOKS)


def execute_notebook(path: Path, timeout: int = 600) -> nbformat.NotebookNode:
    """Run ``path`` with nbclient in this interpreter's kernel; raises on any cell error."""
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    return notebook


def git_filter(paths: list[Path]) -> None:
    """Run nbstripout on ``paths`` in place as the git clean filter is set up in docs/notebooks.md."""
    keys = " ".join(tutorials.GIT_FILTER_EXTRA_KEYS)
    subprocess.run([sys.executable, "-m", "nbstripout", "--extra-keys", keys, *map(str, paths)],
                   check=True, cwd=paths[0].parent, timeout=120)


def as_saved_by_jupyterlab(text: str, seed: int) -> str:
    """``text`` after a run and save in JupyterLab: outputs, counts, fresh cell ids, Lab and jupytext metadata."""
    notebook = nbformat.reads(text, as_version=4)
    for count, cell in enumerate(notebook.cells, start=1):
        cell.id = f"{seed:04x}{count:04x}-lab-cell"
        if cell.cell_type == "code":
            cell.execution_count = count
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="ran\n"),
                            nbformat.v4.new_output("execute_result", data={"text/plain": "1"}, execution_count=count)]
    notebook.metadata.language_info = {"name": "python", "version": "3.11.2", "mimetype": "text/x-python"}
    notebook.metadata.jupytext = {"cell_metadata_filter": "-all", "notebook_metadata_filter": "kernelspec,-all"}
    notebook.metadata.widgets = {"application/vnd.jupyter.widget-state+json": {"state": {}, "version_major": 2}}
    return nbformat.writes(notebook) + "\n"


def test_every_notebook_is_the_build_of_its_source_without_outputs():
    assert [p.name[:2] for p in SOURCES] == ["01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11",
                                             "12", "13"]
    assert ALL == [tutorials.notebook_path(source) for source in SOURCES], "a notebook without a .py source"
    for source in SOURCES:
        path = tutorials.notebook_path(source)
        notebook = nbformat.read(path, as_version=4)
        code_cells = [c for c in notebook.cells if c.cell_type == "code"]
        assert all(not c.outputs and c.execution_count is None for c in code_cells), \
            f"{path.name} is stored with outputs (a JupyterLab save?): run `make notebooks`"
        assert path.read_text(encoding="utf-8") == tutorials.render(source), \
            f"{path.name} is not the build of {source.name}: run `make notebooks`"


def test_a_paired_jupyterlab_save_writes_the_source_back_unchanged():
    """jupytext, paired through notebooks/jupytext.toml, turns each notebook back into exactly its .py source."""
    import jupytext
    from jupytext.config import load_jupytext_config
    from jupytext.paired_paths import paired_paths

    for source in SOURCES:
        path = tutorials.notebook_path(source)
        config = load_jupytext_config(str(path))
        pairs = paired_paths(str(path), "ipynb", config.default_formats(str(path)))
        assert [Path(p) for p, _ in pairs] == [path, source], "notebooks/jupytext.toml pairs them"
        text = source.read_text(encoding="utf-8")
        assert jupytext.reads(text, fmt=tutorials.SOURCE_FORMAT).metadata["kernelspec"] == tutorials.KERNELSPEC
        notebook = nbformat.reads(tutorials.render(source), as_version=4)
        assert jupytext.writes(notebook, fmt=tutorials.SOURCE_FORMAT, config=config) == text, source.name


def test_git_filter_keeps_built_notebooks_and_strips_a_run_back_to_the_build(tmp_path):
    built = {source.stem: tutorials.render(source) for source in SOURCES}
    stored, ran = tmp_path / "stored", tmp_path / "ran"
    stored.mkdir()
    ran.mkdir()
    for seed, (stem, text) in enumerate(built.items()):
        (stored / f"{stem}.ipynb").write_text(text, encoding="utf-8")
        saved = as_saved_by_jupyterlab(text, seed)
        assert saved != text
        (ran / f"{stem}.ipynb").write_text(saved, encoding="utf-8")
    git_filter(sorted(stored.iterdir()) + sorted(ran.iterdir()))
    for stem, text in built.items():
        assert (stored / f"{stem}.ipynb").read_text(encoding="utf-8") == text, f"the filter changes {stem}"
        assert (ran / f"{stem}.ipynb").read_text(encoding="utf-8") == text, f"a run {stem} is stored as built"


def test_build_is_deterministic_and_keeps_edits_made_only_in_the_notebook(tmp_path):
    source = tmp_path / SOURCES[-1].name
    source.write_text(SOURCES[-1].read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "jupytext.toml").write_text((NOTEBOOKS / "jupytext.toml").read_text())
    path = tutorials.notebook_path(source)
    assert tutorials.build(tmp_path) == [path]
    assert path.read_text(encoding="utf-8") == tutorials.notebook_path(SOURCES[-1]).read_text(encoding="utf-8")
    assert tutorials.build(tmp_path) == [] and tutorials.main([str(tmp_path), "--check"]) == 0

    path.write_text(as_saved_by_jupyterlab(tutorials.render(source), seed=1), encoding="utf-8")   # run in Lab
    assert tutorials.main([str(tmp_path), "--check"]) == 1
    assert tutorials.build(tmp_path) == [path] and path.read_text(encoding="utf-8") == tutorials.render(source)

    notebook = nbformat.read(path, as_version=4)
    notebook.cells[-1].source += "\nprint('an edit made in the .ipynb only')"
    nbformat.write(notebook, path)
    edited = path.read_text(encoding="utf-8")
    past = source.stat().st_mtime - 60
    os.utime(source, (past, past))                             # the notebook is newer than its source
    with pytest.raises(tutorials.NotebookEdited, match="jupytext --sync"):
        tutorials.build(tmp_path)
    assert tutorials.main([str(tmp_path)]) == 1 and path.read_text(encoding="utf-8") == edited

    os.utime(path, (past - 60, past - 60))                     # the source is newer: it wins
    assert tutorials.build(tmp_path) == [path] and path.read_text(encoding="utf-8") == tutorials.render(source)


TUTORIALS = [source for source in SOURCES
             if source.name[:2] in ("01", "02", "03", "04", "06", "07", "08", "09", "10", "11", "12", "13")]


@pytest.mark.parametrize("source", TUTORIALS, ids=[s.stem for s in TUTORIALS])
def test_tutorial_opens_with_goals_ends_with_next_steps_and_has_an_exercise(source):
    """Every tutorial says what you learn and need, asks for a prediction it then checks, and ends with
    what to try next (05 is the planner's notebook, checked with it)."""
    cells = nbformat.reads(tutorials.render(source), as_version=4).cells
    markdown = [c.source for c in cells if c.cell_type == "markdown"]
    assert "**What you will learn**" in markdown[0] and "**What you need**" in markdown[0], source.name
    last_heading = [m for m in markdown if "\n## " in f"\n{m}"][-1]
    assert "## What to try next" in last_heading, source.name
    assert all(c.cell_type == "markdown" or "cluster.stop()" in c.source for c in cells[cells.index(
        next(c for c in cells if c.cell_type == "markdown" and c.source == last_heading)):]), source.name
    if source.name[:2] != "07":
        assert any("**Predict**" in m for m in markdown), f"{source.name}: no predict-and-check exercise"


@pytest.mark.mpi
@pytest.mark.parametrize("path", ALL, ids=[p.stem for p in ALL])
def test_notebook_runs_headless(path, tmp_path, monkeypatch):
    start = time.monotonic()
    if path.name.startswith(("04", "08", "09", "10", "13")):
        monkeypatch.setenv("TMPDIR", str(tmp_path))      # the kernel's temporary folders land here
    notebook = execute_notebook(path)
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs) or path.name.startswith("06")
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    check_printed_output(path.name[:2], text, tmp_path)
    print(f"{path.name}: {time.monotonic() - start:.1f} s")


def test_demo_extracts_figures_summary_and_html(tmp_path):
    """The demo's post-processing on a small executed-looking notebook (no kernel needed)."""
    import base64

    from nbformat.v4 import new_code_cell, new_notebook, new_output

    from mpi4dl_nb import viz
    from mpi4dl_nb.config import ParallelConfig
    from mpi4dl_nb.notebook import demo

    png = viz.png_bytes(viz.draw_rank_layout(ParallelConfig()))
    summary = {"configuration": ParallelConfig().as_dict(), "world_size": 5, "image_size": 64,
               "batch_size": 2, "steps": 1, "exact": True, "max_loss_error": 0.0,
               "max_weight_error": 1e-16, "images_per_second": 1.5,
               "memory_measured_mb": [1.0] * 5, "memory_estimate_mb": [1.1] * 5,
               "serial_images_per_second": 2.0, "serial_memory_mb": 4.0, "held_out_steps": [4, 8, 12],
               "held_out_accuracy": [0.5, 0.5, 0.75], "chance_accuracy": 0.5, "held_out_images": 32,
               "held_out_crops": 4, "curve_steps": 12, "curve_batch_size": 4}
    cell = new_code_cell("x", outputs=[
        new_output("display_data", data={"image/png": base64.b64encode(png).decode()}),
        new_output("stream", name="stdout", text="noise\n" + demo.SUMMARY_MARK + json.dumps(summary) + "\n")])
    notebook = new_notebook(cells=[cell])
    figures = demo.save_figures(notebook, tmp_path / "figures", "nb")
    assert [f.name for f in figures] == ["nb_cell00_0.png"] and figures[0].read_bytes() == png
    found = demo.find_summary(notebook)
    assert found == demo.DemoSummary(**summary)
    text = demo.format_summary(found)
    assert "EXACT" in text and "5 MPI ranks" in text and "r4: 1.0 MB (est. 1.1)" in text
    assert "one process   : 2.00 images/s, 4.0 MB (largest rank: 0.25x)" in text
    assert ("held-out      : accuracy 0.75 after 12 steps (first evaluation, step 4: 0.50; chance 0.50) on 32 "
            "images of 4 crops never trained on: LEARNS") in text
    assert found.learns and demo.exit_code(found) == 0
    flat = dataclasses.replace(found, held_out_accuracy=[0.5, 0.75, 0.5])      # back to chance at the end
    assert not flat.learns and demo.exit_code(flat) == demo.EXIT_NOT_LEARNING
    assert "DOES NOT LEARN" in demo.format_summary(flat)
    assert not dataclasses.replace(found, held_out_accuracy=[0.75, 0.75]).learns   # no better than its start
    older = dataclasses.replace(found, held_out_accuracy=None, chance_accuracy=None)
    assert "no learning-curve run" in demo.format_summary(older) and demo.exit_code(older) == demo.EXIT_NOT_LEARNING
    assert demo.exit_code(dataclasses.replace(found, exact=False)) == demo.EXIT_NOT_EXACT
    html = demo.export_html(notebook, tmp_path / "nb.html").read_text()
    assert "<html" in html.lower() and "image/png" in html
    with pytest.raises(SystemExit):
        demo.main(["--notebook", str(tmp_path / "missing.ipynb")])
