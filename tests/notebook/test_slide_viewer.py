"""SlideViewer: heat map over the slide by level, cell picking, probabilities of the picked cell."""

from __future__ import annotations

import numpy as np

from mpi4dl_nb.notebook.widgets.slide_viewer import SlideViewer
from tests.support.infer_data import make_slide


def test_viewer_levels_opacity_and_cell_inspection(tmp_path):
    slide = make_slide(tmp_path / "s.tif", 200, 300)
    probs = np.random.default_rng(0).random((2, 40, 66)).astype(np.float32)
    probs[1] = 1 - probs[0]
    probs[:, :5, :5] = np.nan                       # a background window
    np.save(tmp_path / "p.npy", probs)
    viewer = SlideViewer(slide, tmp_path / "p.npy", stride=4, field=(12, 41), classes=["a", "b"])
    assert [o[1] for o in viewer.level.options] == [0, 1, 2]
    renders = viewer.view.renders
    viewer.level.value = 0
    viewer.opacity.value = 0.8
    assert viewer.view.renders == renders + 2
    assert viewer.select(4 * 20 + 14, 4 * 10 + 14) == (10, 20)     # a pixel at the centre of cell (10, 20)'s field
    assert viewer.cell == (10, 20) and f"b: {probs[1, 10, 20]:.3f}" in viewer.info.value
    bars = viewer.inspector.figure.axes[1].patches
    assert [round(b.get_width(), 6) for b in bars] == [round(float(v), 6) for v in probs[:, 10, 20]]
    viewer.select(0, 0)
    assert viewer.cell == (0, 0) and "not computed" in viewer.info.value
    x0, y0, vw, vh = viewer.viewport()
    assert (vw, vh) == (300, 200) and (x0, y0) == (0, 0)
