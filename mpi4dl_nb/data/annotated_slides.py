"""Whole-slide images with QuPath annotations: tiles as SlideDataset cuts them, each box's mask rasterised alone.

Each slide ``S.<ext>`` comes with ``S.geojson`` (or ``S.json``) beside it. ``--classes`` gives the class
names in label order; the first is the class of every pixel no annotation covers (e.g. ``background``),
and the others are drawn in that order, so where annotations overlap the later class wins (as QuPath's
``LabeledImageServer`` draws its labels). ``read_mask(i, box)`` rasterises only the polygons that reach
the box, at the training level, so a spatial rank builds only its own tile of a mask. Annotations that cannot label
their slide (an unknown class, a vertex outside it, an invalid polygon) are refused naming the file and the feature;
with ``repair`` invalid polygons are repaired instead (``data/annotation_repair.py``), each change said once.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from .annotation_repair import Repair, repair_annotations, tell_repairs
from .bounds import slide_bounds
from .dataset import Box, check_box
from .files import ANNOTATION_SUFFIXES
from .geojson import AnnotationError, Annotations, read_annotations
from .pathology import Slide, SlideDataset, open_slide
from .rasterize import label_map
from .stain import StainNormalizer
from .tissue_mask import TissueMethod

SHOWN_PROBLEMS = 3


def annotation_of(slide: Path) -> Path:
    """The GeoJSON file beside ``slide`` (same stem); ValueError naming the names tried."""
    for suffix in ANNOTATION_SUFFIXES:
        candidate = slide.with_suffix(suffix)
        if candidate.is_file():
            return candidate
    raise ValueError(f"slide {slide.name} has no annotations: expected {slide.stem}.geojson (QuPath: File > "
                     f"Object data > Export as GeoJSON) beside it")


def read_usable(path: Path, repair: bool = False) -> tuple[Annotations, tuple[Repair, ...]]:
    """The annotations of ``path`` (AnnotationError naming the file when unreadable), their invalid polygons repaired
    when ``repair`` (with what changed; no changes without)."""
    annotations = read_annotations(path)
    return repair_annotations(annotations) if repair else (annotations, ())


def problem_text(found: Sequence[str]) -> str | None:
    """The first few of ``found`` as one message (None: no problem)."""
    if not found:
        return None
    more = f" (and {len(found) - SHOWN_PROBLEMS} more)" if len(found) > SHOWN_PROBLEMS else ""
    return "; ".join(found[:SHOWN_PROBLEMS]) + more


def annotation_problems(slide: Path, classes: Sequence[str], opener: Callable[[Path], Slide] = open_slide,
                        repair: bool = False) -> str | None:
    """Why ``slide``'s annotations cannot label it for ``classes`` (None: usable): a missing or broken file,
    an unknown class, a polygon outside the slide or invalid (a ring crossing itself, a hole crossing or outside
    its outer ring, ...; with ``repair`` an invalid polygon is repaired instead)."""
    try:
        annotations, _ = read_usable(annotation_of(slide), repair)
        handle = opener(slide)
        try:       # QuPath's image: the slide's bounds, where its annotations' coordinates start
            bounds = slide_bounds(getattr(handle, "properties", {}), tuple(handle.level_dimensions[0]))
            width, height = bounds.width, bounds.height
        finally:
            handle.close()
    except (AnnotationError, ValueError, OSError) as err:
        return str(err)
    return problem_text(annotations.problems(classes, width, height))


class AnnotatedSlideDataset:
    """Slides cut into ``image_size`` tiles at ``level`` (tissue tiles only, as SlideDataset), with masks from
    their annotations for ``classes`` (label = position in ``classes``; 0 where nothing is annotated).

    ``mpp``/``source_mpp``: tiles at a resolution as SlideDataset reads them (a level, then shrunk); the
    polygons are rasterised directly at that resolution (pixel centres, no label resampling). ``tissue``: how
    SlideDataset finds the tissue tiles. Annotations that cannot label their slide raise ValueError naming the file
    and the feature; ``repair_annotations``: invalid polygons repaired instead (``repairs``), each change said
    once (rank 0)."""

    def __init__(self, slides: Sequence[str | Path], image_size: int, classes: Sequence[str], *, level: int = 0,
                 min_tissue: float = 0.5, opener: Callable[[Path], Slide] = open_slide, mpp: float | None = None,
                 source_mpp: float | None = None, tissue: TissueMethod = TissueMethod.SATURATION,
                 repair_annotations: bool = False) -> None:
        if len(classes) < 2:
            raise ValueError(f"annotated slides need at least 2 classes (the unannotated pixels' first), got "
                             f"{list(classes)}")
        self.slides = SlideDataset(slides, image_size, level=level, min_tissue=min_tissue, opener=opener, mpp=mpp,
                                   source_mpp=source_mpp, tissue=tissue)
        self.mpp = self.slides.mpp
        self.classes = tuple(classes)
        read = [read_usable(annotation_of(p), repair_annotations) for p in self.slides.paths]
        self.annotations: list[Annotations] = [annotations for annotations, _ in read]
        self.repairs: tuple[Repair, ...] = tuple(repair for _, repairs in read for repair in repairs)
        found = [problem for annotations, bounds in zip(self.annotations, self.slides.bounds)
                 for problem in annotations.problems(self.classes, bounds.width, bounds.height)]
        if found:
            raise ValueError(problem_text(found))
        tell_repairs(self.repairs)
        self._drawn = [a.by_class(self.classes) for a in self.annotations]
        self.files = [*self.slides.paths, *(a.path for a in self.annotations)]
        self.image_size = image_size
        self.channels = 3
        self.num_classes = len(self.classes)
        self.level = level

    def __len__(self) -> int:
        return len(self.slides)

    def label(self, index: int) -> int:
        return 0

    def read(self, index: int, box: Box | None = None) -> torch.Tensor:
        return self.slides.read(index, box)

    @property
    def stain(self) -> StainNormalizer | None:
        """The normaliser the images are read through (None: none)."""
        return self.slides.stain

    def use_stain(self, normalizer: StainNormalizer | None) -> None:
        """Normalise the images' stains with ``normalizer`` (None: as stored)."""
        self.slides.use_stain(normalizer)

    def read_mask(self, index: int, box: Box | None = None) -> torch.Tensor:
        tile = self.slides.tiles[index]
        r0, r1, c0, c1 = check_box(box, self.image_size)
        level_box = (tile.y + r0, tile.y + r1, tile.x + c0, tile.x + c1)
        pixel = self.slides.downsample[tile.slide] * self.slides.choices[tile.slide].scale   # level-0 px per pixel
        labels = label_map(self._drawn[tile.slide], level_box, pixel)
        return torch.from_numpy(np.ascontiguousarray(labels))

    def close(self) -> None:
        """Close every open slide."""
        self.slides.close()
