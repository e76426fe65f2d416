"""One annotated polygon (an outer ring and its holes) checked by the OGC rules as shapely applies them, the area the
even-odd rule paints of it, and its repair with ``shapely.make_valid``.

A valid polygon's rings are simple and its holes lie inside its outer ring without crossing it or each other; then
the even-odd fill (``data/rasterize.py``) paints exactly its interior. An invalid one paints what nobody drew: the part
of a hole outside its outer ring is painted as the class, a pentagram loses its centre (wound twice). The repair
takes GeoJSON's meaning of a polygon: the outer ring made valid (``make_valid``'s *structure* method: the area it
encloses), minus its holes made valid the same way.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np

try:
    import shapely
    from shapely.geometry.base import BaseGeometry
except ImportError as err:     # the `slides` extra brings it, with OpenSlide
    raise ImportError("annotated slides are checked with shapely: pip install 'mpi4dl-nb[slides]'") from err

Rings = Sequence[np.ndarray]             # an outer ring, then its holes: each (k, 2) x, y, not closed
REASON = re.compile(r"^(?P<kind>[^\[]+)\[(?P<x>\S+) (?P<y>\S+)\]")
NEAR = 1e-7                              # a ring passes through GEOS's point within this share of the polygon's size


class Fault(Enum):
    """What GEOS's validity test found (the text ``shapely.is_valid_reason`` starts with)."""

    CROSSING = "Self-intersection"
    TOUCHING = "Ring Self-intersection"
    HOLE_OUTSIDE = "Hole lies outside shell"
    NESTED_HOLES = "Holes are nested"
    DISCONNECTED = "Interior is disconnected"
    DUPLICATE = "Duplicate Rings"
    TOO_FEW_POINTS = "Too few points in geometry component"
    OTHER = ""


@dataclass(frozen=True)
class Invalidity:
    """Why a polygon is invalid: GEOS's fault, where, and the rings through that point."""

    fault: Fault
    text: str                            # GEOS's reason as it gave it
    point: tuple[float, float]
    rings: tuple[int, ...]               # 0: the outer ring, k: hole k

    def describe(self) -> str:
        """The reason in words, naming the rings: ``hole 1 crosses the outer ring near (10.0, 2.0)``."""
        near = f"near ({self.point[0]:.1f}, {self.point[1]:.1f})"
        names = [ring_name(number) for number in self.rings]
        holes = [ring_name(number) for number in self.rings if number] or ["a hole"]
        if self.fault is Fault.CROSSING and len(names) == 1:
            return f"its {names[0]} crosses itself {near}"
        if self.fault is Fault.TOUCHING:
            return f"its {names[0] if names else 'ring'} touches itself {near}"
        if self.fault is Fault.CROSSING and 0 in self.rings:
            return f"{' and '.join(holes)} {'cross' if len(holes) > 1 else 'crosses'} the outer ring {near}"
        if self.fault is Fault.CROSSING:
            return f"{' and '.join(holes)} cross each other {near}"
        if self.fault is Fault.HOLE_OUTSIDE:
            return f"{holes[0]} lies outside the outer ring {near}"
        if self.fault is Fault.NESTED_HOLES:
            return f"{holes[0]} lies inside another hole {near}"
        if self.fault is Fault.DISCONNECTED:
            return f"its holes cut its interior apart {near}"
        if self.fault is Fault.DUPLICATE and len(self.rings) == 2:
            return f"its {ring_name(self.rings[1])} repeats its {ring_name(self.rings[0])} {near}"
        if self.fault is Fault.TOO_FEW_POINTS:
            return f"its {names[0] if names else 'ring'} encloses no area {near}"
        return f"{self.text} {near}"


def ring_name(number: int) -> str:
    """How messages name ring ``number`` of a polygon."""
    return "outer ring" if number == 0 else f"hole {number}"


def _polygon(rings: Rings) -> shapely.Polygon:
    return shapely.Polygon(rings[0], list(rings[1:]))


def _invalidity(geometry: BaseGeometry, rings: Rings, numbers: Sequence[int]) -> Invalidity | None:
    if shapely.is_valid(geometry):
        return None
    reason = str(shapely.is_valid_reason(geometry))
    match = REASON.match(reason)
    if match is None:
        return Invalidity(Fault.OTHER, reason, (float("nan"), float("nan")), tuple(numbers))
    kind = match["kind"].strip()
    fault = next((f for f in Fault if f.value == kind), Fault.OTHER)
    point = (float(match["x"]), float(match["y"]))
    if len(numbers) == 1:
        return Invalidity(fault, reason, point, tuple(numbers))
    outlines = [shapely.LinearRing(rings[n]) for n in numbers]
    distance = np.asarray(shapely.distance(outlines, shapely.Point(point)), dtype=np.float64)
    size = float(np.ptp(np.concatenate([np.asarray(rings[n]) for n in numbers]), axis=0).max())
    through = tuple(n for n, d in zip(numbers, distance) if d <= NEAR * max(size, 1.0))
    return Invalidity(fault, reason, point, through or (numbers[int(np.argmin(distance))],))


def edge_set(ring: np.ndarray) -> frozenset[tuple[float, ...]]:
    """The undirected edges of a closed ``ring``: the same for the same ring from any vertex, either way round."""
    points = [tuple(map(float, p)) for p in np.asarray(ring, dtype=np.float64)]
    return frozenset((*min(a, b), *max(a, b)) for a, b in zip(points, points[1:] + points[:1]))


def _duplicate(rings: Rings) -> Invalidity | None:
    seen: dict[frozenset[tuple[float, ...]], int] = {}
    for number, ring in enumerate(rings):
        edges = edge_set(ring)
        if edges in seen:
            x, y = np.asarray(ring, dtype=np.float64)[0]
            return Invalidity(Fault.DUPLICATE, Fault.DUPLICATE.value, (float(x), float(y)), (seen[edges], number))
        seen[edges] = number
    return None


def invalidity(rings: Rings) -> Invalidity | None:
    """Why the polygon of ``rings`` (outer first, then holes) is invalid, None when it is valid: a ring crossing or
    touching itself (the first such ring), else a fault between rings (a ring repeating another, a hole crossing or
    outside its outer ring, holes inside or across each other)."""
    for number, ring in enumerate(rings):
        alone = _invalidity(shapely.Polygon(ring), rings, [number])
        if alone is not None:
            return alone
    fault = _invalidity(_polygon(rings), rings, list(range(len(rings)))) if len(rings) > 1 else None
    return None if fault is None else _duplicate(rings) or fault      # GEOS calls a repeated ring a crossing


def _polygonal(geometry: BaseGeometry) -> BaseGeometry:
    """The polygons of ``geometry`` (make_valid may add the lines and points a fault collapsed to), united."""
    parts: list[BaseGeometry] = []
    pending = [geometry]
    while pending:
        part = pending.pop()
        if isinstance(part, shapely.Polygon):
            parts.append(part)
        elif isinstance(part, (shapely.MultiPolygon, shapely.GeometryCollection)):
            pending.extend(shapely.get_parts(part))
    return shapely.union_all(parts) if parts else shapely.Polygon()


def painted_region(polygons: Sequence[Rings]) -> BaseGeometry:
    """What the even-odd rule fills of ``polygons`` (``rasterize.label_map`` paints their union, each filled alone):
    each ring's own even-odd region (make_valid's *linework* method), a polygon's rings combined by symmetric
    difference."""
    filled = []
    for rings in polygons:
        region: BaseGeometry = shapely.Polygon()
        for ring in rings:
            region = shapely.symmetric_difference(region, _polygonal(shapely.make_valid(shapely.Polygon(ring))))
        filled.append(region)
    return shapely.union_all(filled) if filled else shapely.Polygon()


def as_polygon(rings: Rings) -> BaseGeometry:
    """The polygon of ``rings`` as it is (for a valid one: what the even-odd rule fills)."""
    return _polygon(rings)


def united_area(geometries: Sequence[BaseGeometry]) -> float:
    """The area ``geometries`` cover together."""
    return float(shapely.union_all(list(geometries)).area) if geometries else 0.0


def repaired(rings: Rings) -> BaseGeometry:
    """The valid geometry ``rings`` stand for: the outer ring's area minus the holes' (each ring made valid alone
    by make_valid's *structure* method); polygons only, possibly several, possibly empty."""
    def enclosed(ring: np.ndarray) -> BaseGeometry:
        return _polygonal(shapely.make_valid(shapely.Polygon(ring), method="structure"))

    holes = shapely.union_all([enclosed(hole) for hole in rings[1:]]) if len(rings) > 1 else shapely.Polygon()
    return _polygonal(shapely.difference(enclosed(rings[0]), holes))


def polygon_rings(geometry: BaseGeometry) -> list[tuple[np.ndarray, ...]]:
    """Each polygon of ``geometry`` as its rings (outer first, then holes; float64 ``(k, 2)``, not closed)."""
    found = []
    for part in shapely.get_parts(geometry):
        if isinstance(part, shapely.Polygon) and not part.is_empty:
            rings = [part.exterior, *part.interiors]
            found.append(tuple(np.asarray(ring.coords, dtype=np.float64)[:-1, :2] for ring in rings))
    return found
