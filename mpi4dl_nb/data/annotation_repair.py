"""``--repair-annotations``: each invalid annotated polygon replaced by its repair (``shapely.make_valid``), and a line
per repaired feature saying what changed: the file, the feature, why, the area painted before and after."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..console import to_stderr
from ..schema import world_rank_from_env
from .geojson import AnnotatedPolygon, Annotations
from .polygon_validity import as_polygon, invalidity, painted_region, polygon_rings, repaired, united_area


@dataclass(frozen=True)
class Repair:
    """What ``--repair-annotations`` changed of one feature: why its polygons were invalid, and the area (level-0
    pixels squared) the even-odd rule painted of them before and paints after."""

    path: Path
    feature: str
    name: str
    reasons: tuple[str, ...]
    before: float
    after: float

    def line(self) -> str:
        """The one line saying what changed."""
        return (f"{self.path}: {self.feature}, class {self.name!r}, repaired ({'; '.join(self.reasons)}): area "
                f"{self.before:,.0f} -> {self.after:,.0f} square pixels at level 0")


def repair_annotations(annotations: Annotations) -> tuple[Annotations, tuple[Repair, ...]]:
    """``annotations`` with every invalid polygon repaired (the rest as they are), and a Repair per changed feature."""
    features: dict[str, list[AnnotatedPolygon]] = {}
    for region in annotations.regions:
        features.setdefault(region.feature, []).append(region)
    regions: list[AnnotatedPolygon] = []
    repairs: list[Repair] = []
    for feature, parts in features.items():
        faults = [invalidity(part.rings) for part in parts]
        if not any(faults):
            regions += parts
            continue
        fixed = [as_polygon(p.rings) if fault is None else repaired(p.rings) for p, fault in zip(parts, faults)]
        for part, fault, geometry in zip(parts, faults, fixed):
            regions += [part] if fault is None else [replace(part, rings=rings) for rings in polygon_rings(geometry)]
        reasons = tuple(("" if part.part is None else f"polygon {part.part}: ") + fault.describe()
                        for part, fault in zip(parts, faults) if fault is not None)
        before = float(painted_region([part.rings for part in parts]).area)
        repairs.append(Repair(annotations.path, feature, parts[0].name, reasons, before, united_area(fixed)))
    return replace(annotations, regions=tuple(regions)), tuple(repairs)


def tell_repairs(repairs: tuple[Repair, ...]) -> None:
    """Each repair's line on stderr, from the job's first rank only (every rank repairs the same files alike)."""
    if world_rank_from_env() in (None, 0):
        for repair in repairs:
            to_stderr(f"mpi4dl_nb: --repair-annotations: {repair.line()}")
