"""Polygon tracing of label maps (pure): rings along pixel edges, holes, diagonal pixels, strips, sums; output
specs; slide placement."""

from __future__ import annotations

import numpy as np
import pytest

from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.infer.outputs.contours import RegionTracer
from mpi4dl_nb.infer.outputs.kinds import OutputKind, OutputSpec, parse_outputs
from mpi4dl_nb.infer.outputs.placement import CellPlacement


def trace(labels, classes, strip, values=None, min_area=0.0):
    values = np.zeros((1, *labels.shape)) if values is None else values
    tracer = RegionTracer(labels.shape[1], classes, values.shape[0], min_area)
    regions = []
    for y in range(0, labels.shape[0], strip):
        regions += tracer.feed(labels[y:y + strip], values[:, y:y + strip])
    return regions + list(tracer.finish())


def raster(regions, shape, label):
    """Pixels whose centre is inside an outer ring and no hole of a ``label`` region (even-odd), overlaps refused."""
    from matplotlib.path import Path

    yy, xx = np.mgrid[0:shape[0], 0:shape[1]]
    centres = np.c_[xx.ravel() + 0.5, yy.ravel() + 0.5]
    out = np.zeros(len(centres), dtype=bool)
    for region in (r for r in regions if r.label == label):
        inside = Path(region.outer).contains_points(centres)
        for hole in region.holes:
            inside &= ~Path(hole).contains_points(centres)
        assert not (out & inside).any(), "regions overlap"
        out |= inside
    return out.reshape(shape)


@pytest.mark.parametrize("seed", range(12))
def test_polygons_cover_exactly_each_class_in_any_strips(seed):
    rng = np.random.default_rng(seed)
    height, width, classes = rng.integers(1, 24), rng.integers(1, 24), rng.integers(1, 4)
    labels = rng.integers(-1, classes, size=(height, width))
    values = rng.random((2, height, width))
    regions = trace(labels, classes, int(rng.integers(1, 6)), values)
    for label in range(classes):
        assert np.array_equal(raster(regions, labels.shape, label), labels == label)
    for region in regions:
        mask = raster([region], labels.shape, region.label)
        assert region.area == mask.sum() and np.allclose(region.sums, values[:, mask].sum(axis=1))
        for ring in (region.outer, *region.holes):
            corners = [tuple(p) for p in ring[:-1]]
            assert len(corners) == len(set(corners)) and tuple(ring[0]) == tuple(ring[-1]), "a simple closed ring"
    assert_valid(regions)


def assert_valid(regions):
    """Every region a valid polygon by shapely (OGC rules: simple rings, holes inside, a connected interior)."""
    import shapely
    from shapely.geometry import Polygon

    for region in regions:
        polygon = Polygon(region.outer, region.holes)
        assert polygon.is_valid, shapely.is_valid_reason(polygon)
        assert polygon.area == region.area


@pytest.mark.parametrize("seed", range(8))
def test_holes_touching_their_shell_or_each_other_at_a_vertex_give_valid_polygons(seed):
    rng = np.random.default_rng(100 + seed)
    labels = (rng.random((40, 48)) < 0.62).astype(np.int64)       # dense speckle: pinches everywhere
    regions = trace(labels, 2, int(rng.integers(1, 9)))
    assert np.array_equal(raster(regions, labels.shape, 1), labels == 1)
    assert_valid(regions)


def test_a_hole_pinched_to_its_shell_twice_splits_the_region():
    labels = np.ones((6, 6), dtype=np.int64)
    labels[0, :] = labels[-1, :] = labels[:, 0] = labels[:, -1] = 0
    labels[2:4, 2:4] = 0                 # a hole ...
    labels[1, 1] = labels[4, 4] = 0      # ... whose corners touch the outside at two vertices: two regions
    regions = [r for r in trace(labels, 2, 3) if r.label == 1]
    assert sorted(r.area for r in regions) == [5, 5] and all(r.holes == () for r in regions)
    assert_valid(regions)


def test_a_ring_with_a_hole_and_diagonal_pixels():
    labels = np.zeros((5, 5), dtype=int)
    labels[1:4, 1:4] = 1
    labels[2, 2] = 0                     # a hole
    labels[4, 4] = 1                     # touches the ring at a corner only: a polygon of its own, touching it
    regions = sorted((r for r in trace(labels, 2, 2) if r.label == 1), key=lambda r: -r.area)
    assert [r.area for r in regions] == [8, 1] and len(regions[0].holes) == 1 and regions[1].holes == ()
    assert sorted(map(tuple, regions[0].holes[0][:-1].tolist())) == [(2, 2), (2, 3), (3, 2), (3, 3)]
    assert [4, 4] in regions[0].outer.tolist() and [4, 4] in regions[1].outer.tolist()
    kept = [r for r in trace(labels, 2, 2, min_area=2) if r.label == 1]
    assert len(kept) == 1 and kept[0].holes == () and kept[0].area == 9      # the speck and the speck hole gone


def test_output_specs():
    assert OutputSpec.parse("a.tif").resolved(segmentation=True).kind is OutputKind.LABELS
    assert OutputSpec.parse("a.tif").resolved(segmentation=False).kind is OutputKind.PROBABILITIES
    assert OutputSpec.parse("a.tiff:preview").kind is OutputKind.PREVIEW
    assert OutputSpec.parse("out/{slide}.geojson").for_slide("s1").path.name == "s1.geojson"
    with pytest.raises(ConfigError, match="unknown kind '.jpg'"):
        OutputSpec.parse("a.jpg")
    with pytest.raises(ConfigError, match="chooses what a .tif holds"):
        OutputSpec.parse("a.npy:labels")
    with pytest.raises(ConfigError, match=r"with --slides every output names one file per slide: put \{slide\}"):
        parse_outputs(["a.npy"], cohort=True)


def test_placement_centres_cells_on_the_pixels_they_describe():
    placement = CellPlacement(stride=4, extent=32, out_shape=(10, 20), read_shape=(70, 100), level0_per_pixel=2.0,
                              mpp=0.5)
    assert placement.shift == 4 and placement.map_shape == (18, 25) and placement.cell_size == 8.0
    assert placement.centre(0) == 32.0 and placement.map_mpp == 2.0        # patch [0, 32) at level 1: 16 -> 32 px
    assert placement.cells_of_map(0, 18, 0) == (0, 10) and placement.cells_of_map(0, 3, 1) == (0, 0)
