"""Slide and patient of each held-out image, and the slide- and patient-level figures of merged tile records."""
from __future__ import annotations

from dataclasses import dataclass

from ..data.dataset import RegionDataset
from ..data.groups import GroupKind, groups_of
from .aggregate import Aggregation, GroupPrediction, by_patient, by_slide, level_metrics
from .metrics import LevelMetrics, Records
from .split import Subset


@dataclass(frozen=True)
class SampleGroups:
    """Per image of an evaluated dataset: its slide and its patient (the slide itself when patients are unknown)."""

    slides: tuple[str, ...]
    patients: tuple[str, ...]
    patients_known: bool

    def slide_predictions(self, records: Records, rule: Aggregation) -> list[GroupPrediction]:
        """Each slide's aggregated prediction from the merged ``records`` (their ``index`` names the image)."""
        rows = [int(i) for i in records.index]
        return by_slide(records, [self.slides[i] for i in rows], [self.patients[i] for i in rows], rule)

    def levels(self, per_slide: list[GroupPrediction], rule: Aggregation, num_classes: int) -> tuple[LevelMetrics, ...]:
        """The slide level, and the patient level when patients are known."""
        found = [level_metrics("slide", per_slide, num_classes)]
        if self.patients_known:
            found.append(level_metrics("patient", by_patient(per_slide, rule), num_classes))
        return tuple(found)


def sample_groups(dataset: RegionDataset, group_by: str | None = None) -> SampleGroups | None:
    """The slide and patient of each image of ``dataset`` (held-out subsets followed to their source; ``group_by``:
    tile names' regex), or None when its images come from no known slide."""
    indices = list(range(len(dataset)))
    while isinstance(dataset, Subset):
        indices, dataset = [dataset.indices[i] for i in indices], dataset.dataset
    groups = groups_of(dataset, group_by)
    if groups.kind not in (GroupKind.SLIDE, GroupKind.PATIENT):
        return None
    return SampleGroups(tuple(groups.slides[i] for i in indices), tuple(groups.names[i] for i in indices),
                        groups.kind is GroupKind.PATIENT)
