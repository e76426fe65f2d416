"""``--repair-annotations``: an invalid polygon repaired as GeoJSON means it (the outer ring's area minus the
holes'), what changed said per feature with the area the even-odd rule painted before and paints after, counted
against the pixels ``label_map`` paints."""

from pathlib import Path

import numpy as np
import pytest

from mpi4dl_nb.data.annotation_repair import repair_annotations
from mpi4dl_nb.data.geojson import parse_annotations
from mpi4dl_nb.data.polygon_validity import invalidity, painted_region, repaired
from mpi4dl_nb.data.rasterize import label_map

OUTER = [[0, 0], [10, 0], [10, 10], [0, 10]]
CROSSING_HOLE = [[5, 2], [15, 2], [15, 8], [5, 8]]     # half inside the outer ring, half outside
OUTSIDE_HOLE = [[20, 2], [25, 2], [25, 8], [20, 8]]
BOX = (0, 30, 0, 30)                                    # integer corners: a pixel per unit square, centres inside


def feature(rings, name="tumor", ident=None):
    return {"type": "Feature", "id": ident, "geometry": {"type": "Polygon", "coordinates": rings},
            "properties": {"classification": {"name": name}}}


def annotations(*features):
    return parse_annotations({"type": "FeatureCollection", "features": list(features)}, Path("s1.geojson"))


def painted(found, classes=("background", "tumor")):
    return label_map(found.by_class(classes), BOX)


@pytest.mark.parametrize("hole, outside, inside", [(CROSSING_HOLE, slice(10, 15), 100 - 30),
                                                    (OUTSIDE_HOLE, slice(20, 25), 100)])
def test_a_hole_crossing_or_outside_its_outer_ring_is_painted_as_the_class_until_repaired(hole, outside, inside):
    found = annotations(feature([OUTER, hole], ident="t1"))
    before = painted(found)
    assert before[2:8, outside].all()                                    # the hole's outside part: the class
    fixed, repairs = repair_annotations(found)
    after = painted(fixed)
    expected = np.zeros((30, 30), np.int64)
    expected[0:10, 0:10] = 1
    expected[2:8, 5:10] = 0 if hole is CROSSING_HOLE else 1
    assert np.array_equal(after, expected) and after.sum() == inside
    assert found.problems(["background", "tumor"], 30, 30) and fixed.problems(["background", "tumor"], 30, 30) == []
    (repair,) = repairs
    assert (repair.before, repair.after) == (before.sum(), inside)          # even-odd painted pixels, then repaired
    assert repair.line().startswith("s1.geojson: feature 0 ('t1'), class 'tumor', repaired (hole 1 ")
    assert repair.line().endswith(f"area {before.sum():,} -> {inside} square pixels at level 0")


def test_valid_features_are_kept_as_they_are_and_only_changed_ones_are_reported():
    valid = feature([OUTER, [[2, 2], [4, 2], [4, 4], [2, 4]]], "stroma")
    figure_eight = feature([[[12, 12], [20, 20], [20, 12], [12, 20]]], ident="b")
    found = annotations(valid, figure_eight)
    fixed, repairs = repair_annotations(found)
    assert fixed.regions[0] is found.regions[0]
    assert [r.feature for r in repairs] == ["feature 1 ('b')"]
    assert "its outer ring crosses itself near (16.0, 16.0)" in repairs[0].reasons[0]
    assert len(fixed.regions) == 3 and all(invalidity(r.rings) is None for r in fixed.regions)   # two triangles
    assert repairs[0].before == repairs[0].after == 32.0


def test_the_area_painted_is_the_even_odd_fill_and_the_repair_fills_a_pentagram_whole():
    turns = np.pi / 2 + np.arange(5) * 4 * np.pi / 5
    star = np.stack([500 + 400 * np.cos(turns), 500 + 400 * np.sin(turns)], axis=1)
    filled = label_map([[], [(star,)]], (0, 1000, 0, 1000)).sum()             # the centre pentagon left out
    assert abs(painted_region([(star,)]).area - filled) < 0.005 * filled
    assert repaired((star,)).area > 1.4 * filled                              # its five points and its centre


def test_a_multipolygon_keeps_its_valid_polygons_and_names_the_repaired_one():
    square = [[40, 40], [50, 40], [50, 50], [40, 50]]
    found = parse_annotations([{"type": "Feature", "geometry": {"type": "MultiPolygon", "coordinates": [
        [square], [OUTER, CROSSING_HOLE]]}, "properties": {"classification": {"name": "tumor"}}}], Path("m.geojson"))
    fixed, (repair,) = repair_annotations(found)
    assert fixed.regions[0] is found.regions[0] and len(fixed.regions) == 2
    assert repair.reasons == ("polygon 1: hole 1 crosses the outer ring near (10.0, 2.0)",)
    assert (repair.before, repair.after) == (100 + 100, 100 + 70)
