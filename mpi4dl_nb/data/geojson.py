"""QuPath annotations read from GeoJSON and checked: classes, the slide's extent, valid polygons.

QuPath's *File > Object data > Export as GeoJSON* (or ``exportObjectsToGeoJson(..., "FEATURE_COLLECTION")``)
writes a FeatureCollection whose features carry a ``Polygon`` or ``MultiPolygon`` geometry in level-0
pixel coordinates (origin at the top-left corner of the full-resolution image) and
``properties.classification.name``; a plain JSON array of features (QuPath's other export) and a single
Feature are read too. A polygon is an outer ring and its holes; rings are closed (a missing closing
vertex is added). Features without area (points, lines: cell counts, rulers) are skipped and counted.

Refused, naming the file and the feature (its position, its id and name when it has them): text
that is not JSON, a feature that is not a Feature, a geometry that is not a list of rings of ``[x, y]``
numbers with at least three distinct vertices, a missing classification. ``problems`` adds what depends
on the run: a class not among ``--classes``, a vertex outside the slide, and a polygon (each part of a
MultiPolygon) that is not valid by the OGC rules (``data/polygon_validity.py``: a ring crossing itself, a hole
crossing, outside or repeating its outer ring, holes inside or across each other). Such a polygon is refused,
not silently repaired: the even-odd rule would paint what nobody drew (a hole's part outside its outer ring as
the class); ``--repair-annotations`` repairs it and says what changed (``data/annotation_repair.py``).
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

AREA_TYPES = ("Polygon", "MultiPolygon")
SKIPPED_TYPES = ("Point", "MultiPoint", "LineString", "MultiLineString")
REPAIR_HINT = "fix it in QuPath, or pass --repair-annotations (shapely.make_valid; each change is reported)"


@dataclass(frozen=True)
class AnnotatedPolygon:
    """One polygon of one feature: its class name and rings (outer first, then holes), each ``(k, 2)`` x, y."""

    name: str
    rings: tuple[np.ndarray, ...]
    feature: str              # how messages name the feature: "feature 3 ('a1b2', 'Region 7')"
    part: int | None = None   # its position among a MultiPolygon's polygons (None: a Polygon)

    @property
    def where(self) -> str:
        """How messages name this polygon: its feature, and its part of a MultiPolygon."""
        return self.feature if self.part is None else f"{self.feature} polygon {self.part}"


@dataclass(frozen=True)
class Annotations:
    """The areas a GeoJSON file annotates, and the features it skipped (no area) by geometry type."""

    path: Path
    regions: tuple[AnnotatedPolygon, ...]
    skipped: Mapping[str, int] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        """Class names in first-seen order."""
        return list(dict.fromkeys(r.name for r in self.regions))

    def by_class(self, classes: Sequence[str]) -> list[list[tuple[np.ndarray, ...]]]:
        """For each of ``classes``, the rings of its regions (what ``rasterize.label_map`` draws)."""
        return [[r.rings for r in self.regions if r.name == name] for name in classes]

    def problems(self, classes: Sequence[str], width: float, height: float) -> list[str]:
        """What makes these annotations unusable for ``classes`` on a ``width x height`` (level 0) slide."""
        from .polygon_validity import invalidity  # shapely: the `slides` extra

        if not self.regions:
            held = ", ".join(f"{count} {kind}" for kind, count in self.skipped.items()) or "no features"
            return [f"{self.path}: no areas to draw a mask from ({held}); annotate regions as polygons in QuPath "
                    f"(points and lines mark no area), or leave the slide out"]
        found = []
        for region in self.regions:
            if region.name not in classes:
                found.append(f"{region.feature}: class {region.name!r} is not among --classes {','.join(classes)}")
                continue
            points = np.concatenate(region.rings)
            bad = (points[:, 0] < 0) | (points[:, 1] < 0) | (points[:, 0] > width) | (points[:, 1] > height)
            if bad.any():
                x, y = points[np.argmax(bad)]
                found.append(f"{region.feature}: vertex ({x:g}, {y:g}) lies outside the slide (0..{width:g} x "
                             f"0..{height:g} pixels at level 0)")
                continue
            fault = invalidity(region.rings)
            if fault is not None:
                found.append(f"{region.where}: {fault.describe()}; this {region.name} polygon is invalid: "
                             f"{REPAIR_HINT}")
        return [f"{self.path}: {text}" for text in found]


class AnnotationError(ValueError):
    """A GeoJSON file that cannot be read as annotations; the message names the file and the feature."""


def _feature_name(number: int, feature: Mapping[str, object]) -> str:
    properties = feature.get("properties")
    name = properties.get("name") if isinstance(properties, Mapping) else None
    labels = list(dict.fromkeys(label for label in (feature.get("id"), name) if isinstance(label, (str, int))))
    return f"feature {number}" + (f" ({', '.join(map(repr, labels))})" if labels else "")


def _ring(raw: object, where: str) -> np.ndarray:
    try:
        points = np.asarray(raw, dtype=np.float64)
    except (TypeError, ValueError):
        points = np.zeros((0, 0))
    if points.ndim != 2 or points.shape[1] < 2 or not np.isfinite(points).all():
        raise AnnotationError(f"{where}: a ring must be a list of [x, y] numbers")
    points = points[:, :2]
    if len(points) > 1 and np.array_equal(points[0], points[-1]):
        points = points[:-1]
    if len(np.unique(points, axis=0)) < 3:
        raise AnnotationError(f"{where}: a ring needs at least 3 distinct vertices, it has "
                              f"{len(np.unique(points, axis=0))}")
    return points


def _polygons(geometry: Mapping[str, object], where: str) -> Iterator[list[object]]:
    kind, coordinates = geometry.get("type"), geometry.get("coordinates")
    if kind == "GeometryCollection":
        parts = geometry.get("geometries")
        if not isinstance(parts, list):
            raise AnnotationError(f"{where}: a GeometryCollection needs a list of geometries")
        for part in parts:
            if not isinstance(part, Mapping):
                raise AnnotationError(f"{where}: a geometry must be an object")
            yield from _polygons(part, where)
        return
    if kind in SKIPPED_TYPES:
        return
    if kind not in AREA_TYPES or not isinstance(coordinates, list) or not coordinates:
        raise AnnotationError(f"{where}: geometry {kind!r} with {type(coordinates).__name__} coordinates; "
                              f"expected a Polygon or MultiPolygon")
    for polygon in coordinates if kind == "MultiPolygon" else [coordinates]:
        if not isinstance(polygon, list) or not polygon:
            raise AnnotationError(f"{where}: a polygon must be a non-empty list of rings")
        yield polygon


def _class_name(feature: Mapping[str, object], where: str) -> str:
    properties = feature.get("properties")
    classification = properties.get("classification") if isinstance(properties, Mapping) else None
    name = classification.get("name") if isinstance(classification, Mapping) else None
    if not isinstance(name, str) or not name:
        raise AnnotationError(f"{where} has no properties.classification.name; classify it in QuPath or "
                              f"remove it")
    return name


def parse_annotations(data: object, path: Path) -> Annotations:
    """The annotations of parsed GeoJSON ``data`` (a FeatureCollection, a list of Features, or one Feature)."""
    if isinstance(data, Mapping) and data.get("type") == "FeatureCollection":
        features = data.get("features")
    elif isinstance(data, Mapping) and data.get("type") == "Feature":
        features = [data]
    else:
        features = data
    if not isinstance(features, list):
        raise AnnotationError(f"{path}: expected a GeoJSON FeatureCollection (QuPath: File > Object data > "
                              f"Export as GeoJSON), got {type(data).__name__}")
    regions: list[AnnotatedPolygon] = []
    skipped: dict[str, int] = {}
    for number, feature in enumerate(features):
        if not isinstance(feature, Mapping) or feature.get("type") != "Feature":
            raise AnnotationError(f"{path}: feature {number} is not a GeoJSON Feature object")
        name = _feature_name(number, feature)
        where = f"{path}: {name}"
        geometry = feature.get("geometry")
        if not isinstance(geometry, Mapping):
            raise AnnotationError(f"{where} has no geometry object")
        polygons = list(_polygons(geometry, where))
        if not polygons:
            kind = str(geometry.get("type"))
            skipped[kind] = skipped.get(kind, 0) + 1
            continue
        label = _class_name(feature, where)
        for part, polygon in enumerate(polygons):
            rings = tuple(_ring(ring, where) for ring in polygon)
            regions.append(AnnotatedPolygon(label, rings, name, part if len(polygons) > 1 else None))
    return Annotations(path, tuple(regions), skipped)


def read_annotations(path: str | Path) -> Annotations:
    """The annotations of a GeoJSON file; AnnotationError naming the file (and the feature) when unreadable."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise AnnotationError(f"{file}: cannot read it: {err}") from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise AnnotationError(f"{file}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
    return parse_annotations(data, file)
