"""Every tutorial notebook runs top to bottom, headless, against a real local MPI cluster."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import nbformat
import pytest

from tests.support.mpirun import REPO

NOTEBOOKS = REPO / "notebooks"
ALL = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def execute_notebook(path: Path, timeout: int = 600) -> nbformat.NotebookNode:
    """Run ``path`` with nbclient in this interpreter's kernel; raises on any cell error."""
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    return notebook


def test_notebooks_are_stored_without_outputs_and_built_from_the_generator():
    assert [p.name[:2] for p in ALL] == ["01", "02", "03", "04", "05", "06"]
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_notebooks", NOTEBOOKS / "build_notebooks.py")
    build_notebooks = importlib.util.module_from_spec(spec)
    saved, sys.dont_write_bytecode = sys.dont_write_bytecode, True   # no __pycache__ in notebooks/
    try:
        spec.loader.exec_module(build_notebooks)
    finally:
        sys.dont_write_bytecode = saved
    for path in ALL:
        notebook = nbformat.read(path, as_version=4)
        code_cells = [c for c in notebook.cells if c.cell_type == "code"]
        assert all(not c.outputs and c.execution_count is None for c in code_cells), path.name
        expected = [c.source for c in build_notebooks.NOTEBOOKS[path.name]]
        assert [c.source for c in notebook.cells] == expected, f"{path.name}: rerun build_notebooks.py"


@pytest.mark.parametrize("path", ALL, ids=[p.stem for p in ALL])
def test_notebook_runs_headless(path):
    start = time.monotonic()
    notebook = execute_notebook(path)
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs) or path.name.startswith("06")
    if path.name.startswith("04"):
        text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
        line = next(item for item in text.splitlines() if item.startswith("MPI4DL_SUMMARY "))
        summary = json.loads(line.split(" ", 1)[1])
        assert summary["exact"] and summary["world_size"] == 5
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
               "memory_measured_mb": [1.0] * 5, "memory_estimate_mb": [1.1] * 5}
    cell = new_code_cell("x", outputs=[
        new_output("display_data", data={"image/png": base64.b64encode(png).decode()}),
        new_output("stream", name="stdout", text="noise\n" + demo.SUMMARY_MARK + json.dumps(summary) + "\n")])
    notebook = new_notebook(cells=[cell])
    figures = demo.save_figures(notebook, tmp_path / "figures", "nb")
    assert [f.name for f in figures] == ["nb_cell00_0.png"] and figures[0].read_bytes() == png
    assert demo.find_summary(notebook) == summary
    text = demo.format_summary(summary)
    assert "EXACT" in text and "5 MPI ranks" in text and "r4: 1.0 MB (est. 1.1)" in text
    html = demo.export_html(notebook, tmp_path / "nb.html").read_text()
    assert "<html" in html.lower() and "image/png" in html
    with pytest.raises(SystemExit):
        demo.main(["--notebook", str(tmp_path / "missing.ipynb")])
