"""SlideViewer.from_map: a whole-slide model's slide-aligned map (``infer --slides ... --output DIR``'s OME-TIFF)
over its slide: cell geometry from the map's MPP (or the widths without one), values relative to the peak, polygons."""

from __future__ import annotations

import numpy as np
import pytest

from mpi4dl_nb.data.canvas import CanvasPlacement
from mpi4dl_nb.infer.attention_map import on_slide
from mpi4dl_nb.infer.outputs.slide_level import map_paths, slide_placement, write_slide_map
from mpi4dl_nb.notebook.widgets.slide_viewer import SlideViewer
from tests.support.infer_data import make_slide, write_slide


def attention_map(tmp_path, slide, height, width, mpp):
    """A 16x16-cell canvas (stride 4) at the slide's corner, one hot cell (5, 9), written as ``write_slide_map``."""
    cells = np.full((16, 16), 1e-4)
    cells[5, 9] = 1.0 - 255 * 1e-4
    placement = CanvasPlacement("s", 0, 0, 64, (width, height), (0, height, 0, width), 1.0, 0.0)
    looked = on_slide(cells, placement)
    columns = write_slide_map(tmp_path, "s", "attention", looked, slide_placement(placement, 4, 1.0, mpp))
    assert columns["regions"] == 1
    return map_paths(tmp_path, "s", "attention"), cells


def test_the_viewer_lays_a_slide_map_over_its_slide_by_its_mpp(tmp_path):
    image = np.full((96, 80, 3), 200, np.uint8)
    slide = write_slide(tmp_path / "s.tif", image, mpp=0.5)
    (tiff, geojson), cells = attention_map(tmp_path, slide, 96, 80, 0.5)
    viewer = SlideViewer.from_map(slide, tiff, polygons=geojson)
    assert viewer.classes == ["attention"] and viewer.stride == pytest.approx(4.0) and viewer.after == viewer.stride
    assert viewer.probs.shape == (1, 24, 20)                     # the slide's extent in strides
    assert np.isnan(viewer.probs[0, 16:]).all() and np.nanmax(viewer.probs) == pytest.approx(1.0)
    assert viewer.select(9 * 4 + 2, 5 * 4 + 2) == (5, 9) and "attention: 1.000" in viewer.info.value
    assert viewer.show_polygons.value and len(viewer.regions) == 1
    ring = np.asarray(viewer.regions[0].rings[0])
    assert ring.min(axis=0).tolist() == [36.0, 20.0] and ring.max(axis=0).tolist() == [40.0, 24.0]   # cell (5, 9)


def test_without_mpp_the_stride_comes_from_the_widths(tmp_path):
    slide = make_slide(tmp_path / "s.tif", 64, 64)
    (tiff, _), _ = attention_map(tmp_path, slide, 64, 64, None)
    viewer = SlideViewer.from_map(slide, tiff)
    assert viewer.stride == pytest.approx(4.0) and viewer.probs.shape == (1, 16, 16)
    renders = viewer.view.renders
    viewer.opacity.value = 0.3
    assert viewer.view.renders == renders + 1
