"""A cohort's slides cut into tiles as ``SlideDataset`` cuts them, each tile labelled by its slide's manifest label
and grouped by its slide's patient."""
from __future__ import annotations

from .manifest import Cohort
from .pathology import SlideDataset
from .tissue_mask import TissueMethod


class CohortSlides(SlideDataset):
    """The tiles of every slide of ``cohort`` (labels and patients from the manifest)."""

    def __init__(self, cohort: Cohort, image_size: int, *, level: int = 0, min_tissue: float = 0.5,
                 mpp: float | None = None, source_mpp: float | None = None,
                 tissue: TissueMethod = TissueMethod.SATURATION) -> None:
        super().__init__([s.path for s in cohort], image_size, level=level, min_tissue=min_tissue, mpp=mpp,
                         source_mpp=source_mpp, tissue=tissue)
        self.cohort = cohort
        self.slide_labels = cohort.labels
        self.classes = list(cohort.classes)
        self.num_classes = len(self.classes)
        self.patients = [s.patient for s in cohort]
