"""QuPath GeoJSON: polygons, multipolygons and holes read; broken files and features named; run-level problems."""

import json

import pytest

from mpi4dl_nb.data.geojson import AnnotationError, read_annotations


def feature(geometry, name="Tumor", **extra):
    properties = {"objectType": "annotation", "classification": {"name": name, "color": [200, 0, 0]}}
    return {"type": "Feature", "geometry": geometry, "properties": properties, **extra}


SQUARE = [[[10, 10], [50, 10], [50, 50], [10, 50], [10, 10]]]
WITH_HOLE = [[[0, 0], [80, 0], [80, 80], [0, 80], [0, 0]], [[20, 20], [40, 20], [40, 40], [20, 40], [20, 20]]]


def write(tmp_path, data, name="slide.geojson"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_a_qupath_feature_collection_reads_with_holes_and_multipolygons(tmp_path):
    data = {"type": "FeatureCollection", "features": [
        feature({"type": "Polygon", "coordinates": WITH_HOLE}, "Stroma", id="a1"),
        feature({"type": "MultiPolygon", "coordinates": [SQUARE, [[[60, 60], [70, 60], [65, 70]]]]}),
        feature({"type": "Point", "coordinates": [5, 5]}, "Cell"),
        feature({"type": "LineString", "coordinates": [[1, 1], [2, 2]]}, "Ruler")]}
    found = read_annotations(write(tmp_path, data))
    assert [r.name for r in found.regions] == ["Stroma", "Tumor", "Tumor"]
    assert [len(r.rings) for r in found.regions] == [2, 1, 1]
    assert found.regions[0].rings[0].shape == (4, 2)           # the closing vertex dropped
    assert found.regions[2].rings[0].shape == (3, 2)           # an unclosed ring is closed implicitly
    assert found.skipped == {"Point": 1, "LineString": 1} and found.names == ["Stroma", "Tumor"]
    assert "'a1'" in found.regions[0].feature
    drawn = found.by_class(["background", "Tumor", "Stroma"])
    assert [len(polygons) for polygons in drawn] == [0, 2, 1]
    assert found.problems(["background", "Tumor", "Stroma"], 100, 100) == []


def test_a_plain_list_of_features_reads_too(tmp_path):
    found = read_annotations(write(tmp_path, [feature({"type": "Polygon", "coordinates": SQUARE})]))
    assert len(found.regions) == 1


@pytest.mark.parametrize("text, fragment", [
    ('{"type": "FeatureCollection", "features": [', "not valid JSON (line 1"),
    ({"type": "FeatureCollection", "features": [{"type": "Thing"}]}, "feature 0 is not a GeoJSON Feature"),
    ({"type": "FeatureCollection", "features": [feature({"type": "Polygon", "coordinates": [[[0, 0], [1, 1]]]},
                                                        id="z9")]}, "feature 0 ('z9'): a ring needs at least 3"),
    ({"type": "FeatureCollection", "features": [feature({"type": "Polygon", "coordinates": [[["a", 0]]]})]},
     "feature 0: a ring must be a list of [x, y] numbers"),
    ({"type": "FeatureCollection", "features": [
        feature({"type": "Polygon", "coordinates": SQUARE}),
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": SQUARE}, "properties": {}}]},
     "feature 1 has no properties.classification.name"),
    ({"type": "FeatureCollection", "features": [feature({"type": "Circle", "coordinates": [1]})]},
     "geometry 'Circle'"),
    ({"type": "Topology"}, "expected a GeoJSON FeatureCollection"),
])
def test_a_broken_file_names_the_file_and_the_feature(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(AnnotationError) as info:
        read_annotations(path)
    assert str(path) in str(info.value) and fragment in str(info.value)


def test_problems_name_unknown_classes_vertices_outside_and_self_intersections(tmp_path):
    bowtie = [[[0, 0], [40, 40], [40, 0], [0, 40], [0, 0]]]
    data = {"type": "FeatureCollection", "features": [
        feature({"type": "Polygon", "coordinates": SQUARE}, "Necrosis"),
        feature({"type": "Polygon", "coordinates": [[[90, 90], [120, 90], [120, 99]]]}),
        feature({"type": "Polygon", "coordinates": bowtie}, "Stroma", id="bow")]}
    problems = read_annotations(write(tmp_path, data)).problems(["background", "Tumor", "Stroma"], 100, 100)
    assert len(problems) == 3
    assert "feature 0: class 'Necrosis' is not among --classes background,Tumor,Stroma" in problems[0]
    assert "feature 1: vertex (120, 90) lies outside the slide" in problems[1]
    assert "feature 2 ('bow'): its outer ring crosses itself near (20.0, 20.0)" in problems[2]
    assert all(p.startswith(str(tmp_path)) for p in problems)


OUTER = [[0, 0], [10, 0], [10, 10], [0, 10], [0, 0]]


@pytest.mark.parametrize("rings, reason", [
    ([OUTER, [[5, 2], [15, 2], [15, 8], [5, 8], [5, 2]]], "hole 1 crosses the outer ring near (10.0, 2.0)"),
    ([OUTER, [[20, 2], [25, 2], [25, 8], [20, 8], [20, 2]]], "hole 1 lies outside the outer ring near (20.0, 2.0)"),
    ([OUTER, [[1, 1], [9, 1], [9, 9], [1, 9], [1, 1]], [[2, 2], [3, 2], [3, 3], [2, 3], [2, 2]]],
     "hole 2 lies inside another hole near (2.0, 2.0)"),
    ([OUTER, [[1, 1], [3, 1], [3, 3], [1, 3], [1, 1]], [[2, 2], [4, 2], [4, 4], [2, 4], [2, 2]]],
     "hole 1 and hole 2 cross each other near (2.0, 3.0)"),
    ([OUTER, [[0, 10], [10, 10], [10, 0], [0, 0], [0, 10]]], "its hole 1 repeats its outer ring near (0.0, 10.0)"),
    ([OUTER, [[2, 2], [4, 4], [4, 2], [2, 4], [2, 2]]], "its hole 1 crosses itself near (3.0, 3.0)"),
    ([[[0, 0], [2, 0], [1, 1], [2, 2], [0, 2], [1, 1], [0, 0]]], "its outer ring touches itself near (1.0, 1.0)"),
])
def test_an_invalid_polygon_is_a_problem_naming_the_feature_its_class_and_why(tmp_path, rings, reason):
    """Rings each simple can still make an invalid polygon (a hole crossing, outside or repeating the outer ring,
    holes inside or across each other): before shapely's check such files passed (``problems() == []``) and the
    even-odd fill painted what nobody drew."""
    named = feature({"type": "Polygon", "coordinates": rings}, "Stroma", id="r9")
    named["properties"]["name"] = "Region 7"
    data = {"type": "FeatureCollection", "features": [feature({"type": "Polygon", "coordinates": SQUARE}), named]}
    problems = read_annotations(write(tmp_path, data)).problems(["background", "Tumor", "Stroma"], 100, 100)
    assert len(problems) == 1
    assert problems[0].startswith(f"{tmp_path / 'slide.geojson'}: feature 1 ('r9', 'Region 7'): {reason}; ")
    assert "this Stroma polygon is invalid" in problems[0] and "--repair-annotations" in problems[0]


def test_each_polygon_of_a_multipolygon_is_checked_and_named(tmp_path):
    crossing = [OUTER, [[5, 2], [15, 2], [15, 8], [5, 8], [5, 2]]]
    data = [feature({"type": "MultiPolygon", "coordinates": [SQUARE, crossing]}, id="m")]
    problems = read_annotations(write(tmp_path, data)).problems(["background", "Tumor"], 100, 100)
    assert len(problems) == 1 and "feature 0 ('m') polygon 1: hole 1 crosses the outer ring" in problems[0]
