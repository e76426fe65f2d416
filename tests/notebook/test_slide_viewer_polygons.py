"""SlideViewer with polygons: a GeoJSON's rings outlined over the slide at the displayed level, in their class's
colour, one legend entry per class, switched off by its checkbox."""

from __future__ import annotations

import json

import numpy as np

from mpi4dl_nb.infer.outputs.colors import class_color
from mpi4dl_nb.notebook.widgets.slide_viewer import SlideViewer
from tests.support.infer_data import make_slide

SQUARE = [[40.0, 20.0], [120.0, 20.0], [120.0, 100.0], [40.0, 100.0], [40.0, 20.0]]
HOLE = [[60.0, 40.0], [80.0, 40.0], [80.0, 60.0], [60.0, 60.0], [60.0, 40.0]]


def test_polygons_are_outlined_per_class_at_the_displayed_level(tmp_path):
    slide = make_slide(tmp_path / "s.tif", 200, 300)
    np.save(tmp_path / "p.npy", np.full((2, 200, 300), 0.5, np.float32))
    features = [{"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [SQUARE, HOLE]},
                 "properties": {"classification": {"name": "DAB"}}}]
    (tmp_path / "m.geojson").write_text(json.dumps({"type": "FeatureCollection", "features": features}))
    viewer = SlideViewer(slide, tmp_path / "p.npy", stride=1, field=(0, 1), classes=["background", "DAB"],
                         polygons=tmp_path / "m.geojson")
    assert viewer.show_polygons.value and viewer.show_polygons.description == "polygons (1)"
    viewer.level.value = 0
    lines = viewer.view.figure.axes[0].lines
    assert len(lines) == 2                                          # the outer ring and its hole
    assert np.array_equal(lines[0].get_xydata(), np.array(SQUARE))
    assert lines[0].get_color() == tuple(c / 255 for c in class_color(1)) and lines[0].get_label() == "DAB"
    assert [t.get_text() for t in viewer.view.figure.axes[0].get_legend().get_texts()] == ["DAB"]
    viewer.level.value = 1                                          # half the resolution: half the coordinates
    scale = viewer.base.levels[0][0] / viewer.base.levels[1][0]
    assert np.allclose(viewer.view.figure.axes[0].lines[0].get_xydata(), np.array(SQUARE) / scale)
    viewer.show_polygons.value = False
    assert len(viewer.view.figure.axes[0].lines) == 0
