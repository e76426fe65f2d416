"""The group of each image a held-out split keeps on one side: its patient (a cohort's, or read from TCGA barcodes),
else its slide (tiles cut from one slide, or tile files whose names carry the slide), else nothing (ungrouped: the
image alone). A folder mixing TCGA barcodes with other names: the barcodes' slides by patient, the others by slide."""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .barcodes import ORIGIN, tcga_patient, tcga_patients
from .dataset import RegionDataset

if TYPE_CHECKING:
    from .pathology import TileFolderDataset

KNOB = "--group-by"
BY_SLIDE = "slide"    # --group-by slide: slides as the default patterns name them, TCGA barcodes kept whole
# Tile file names (without suffix) that name their slide, tried in order; the first group is the slide.
DEFAULT_PATTERNS = (
    r"(TCGA-[A-Za-z0-9]{2}-[A-Za-z0-9]{4}-[A-Za-z0-9]{3}-[A-Za-z0-9]{2,3}-[A-Za-z0-9]{3,4})[_.-].*",  # TCGA slide
    r"(.+?)[_-]x?\d+[_-]y?\d+",                                                               # <slide>_<x>_<y>
)


class GroupKind(str, Enum):
    """What the groups of a split are."""

    PATIENT = "patient"
    SLIDE = "slide"
    GIVEN = "group"                    # groups given by the caller (``dl.split_dataset(..., groups=...)``)
    UNGROUPED = "ungrouped"

    @property
    def plural(self) -> str:
        return "images" if self is GroupKind.UNGROUPED else f"{self.value}s"


@dataclass(frozen=True)
class Groups:
    """Per image of a dataset: its group (the patient, slide or the image's own name) and its slide."""

    kind: GroupKind
    names: tuple[str, ...]             # the group of each image
    slides: tuple[str, ...]            # the slide of each image (ungrouped: the image's own name)
    origin: str = ""                   # where the groups come from, when not plain (e.g. "from TCGA barcodes")
    own_slides: int = 0                # patients from TCGA barcodes: the slides of other names, each its own group
    alone: frozenset[str] = frozenset()   # patients from TCGA barcodes: the tiles whose names carry no slide (alone)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def heading(self) -> str:
        """How the split is grouped, as its printed summary says it: ``grouped by patient (from TCGA barcodes)``, or
        for a folder mixing TCGA barcodes with other names ``with 12 slides grouped by patient (TCGA barcodes), 4 by
        slide``."""
        if self.own_slides or self.alone:
            barcoded = len(set(self.slides)) - self.own_slides - len(self.alone)
            parts = [f"with {barcoded} slides grouped by patient (TCGA barcodes)",
                     f"{self.own_slides} by slide" if self.own_slides else "",
                     f"{len(self.alone)} images ungrouped (no slide in their names)" if self.alone else ""]
            return ", ".join(part for part in parts if part)
        return f"grouped by {self.kind.value}" + (f" ({self.origin})" if self.origin else "")

    def side_parts(self, indices: Sequence[int]) -> list[str]:
        """The groups of the images ``indices`` as a split's side counts them: ``4 patients, 8 slides``, ``6 slides``;
        a folder mixing TCGA barcodes with other names ``3 patients (6 slides), 2 other slides, 3 images alone``;
        none when ungrouped."""
        if self.kind is GroupKind.UNGROUPED:
            return []
        groups = {self.names[i] for i in indices}
        if self.kind is not GroupKind.PATIENT:
            return [f"{len(groups)} {self.kind.plural}"]
        slides = len({self.slides[i] for i in indices})
        if not self.own_slides and not self.alone:
            return [f"{len(groups)} patients", f"{slides} slides"]
        barcoded = [i for i in indices if tcga_patient(self.names[i]) is not None]
        patients = {self.names[i] for i in barcoded}
        alone = groups & self.alone
        parts = [f"{len(patients)} patients ({len({self.slides[i] for i in barcoded})} slides)",
                 f"{len(groups) - len(patients) - len(alone)} other slides"]
        return parts + ([f"{len(alone)} images alone"] if alone else [])


def ungrouped(count: int) -> Groups:
    """Every image its own group, named by its position."""
    names = tuple(str(i) for i in range(count))
    return Groups(GroupKind.UNGROUPED, names, names)


def given_groups(names: Sequence[object], count: int) -> Groups:
    """Groups the caller names, one per image; ValueError for another count."""
    if len(names) != count:
        raise ValueError(f"groups names {len(names)} groups for {count} images; give one per image")
    text = tuple(str(n) for n in names)
    return Groups(GroupKind.GIVEN, text, text)


def groups_of(dataset: RegionDataset, pattern: str | None = None) -> Groups:
    """The groups of ``dataset``'s images: a cohort's patients, the patients of slides named by TCGA barcodes
    (``data/barcodes.py``), else the slides of a slide dataset or of tile files by ``pattern`` (``--group-by REGEX``,
    first group the slide, or ``slide``: the default patterns without joining TCGA slides into patients; None: the
    default patterns when every file matches one), else ungrouped. ConfigError for a ``pattern`` that is no regex or
    does not match a file, and for a tile folder's slide with tiles in two class folders."""
    from .canvas import SlideCanvases
    from .cohort_slides import CohortSlides
    from .pathology import SlideDataset, TileFolderDataset

    by_slide = pattern == BY_SLIDE
    if isinstance(dataset, CohortSlides):             # the manifest's patients
        slides = tuple(dataset.paths[t.slide].stem for t in dataset.tiles)
        patients = tuple(dataset.patients[t.slide] for t in dataset.tiles)
        return Groups(GroupKind.PATIENT, patients, slides, dataset.cohort.grouping)
    if isinstance(dataset, SlideCanvases):            # a sample per slide
        if dataset.patients != dataset.names:         # a cohort's patients
            origin = ORIGIN if tcga_patients(dataset.names) == tuple(dataset.patients) else ""
            return Groups(GroupKind.PATIENT, tuple(dataset.patients), tuple(dataset.names), origin)
        return named_slides(tuple(dataset.names), by_slide)
    if isinstance(dataset, SlideDataset):
        return named_slides(tuple(dataset.paths[t.slide].stem for t in dataset.tiles), by_slide)
    if isinstance(dataset, TileFolderDataset):
        found = tile_slides(dataset.files, None if by_slide else pattern)
        if found is not None:
            check_one_class_per_slide(dataset, found, pattern)
            return named_slides(found, by_slide or pattern is not None)
        barcoded = None if pattern is not None else barcoded_tiles(dataset)
        if barcoded is not None:
            return barcoded
    elif pattern is not None:
        raise ConfigError(KNOB, f"groups tile files by name; this data ({type(dataset).__name__}) has none; drop "
                                f"{KNOB}")
    return ungrouped(len(dataset))


def named_slides(slides: tuple[str, ...], by_slide: bool) -> Groups:
    """Slides named by a TCGA barcode grouped by patient (unless ``by_slide``), the others each by itself; by slide
    when no name is a barcode."""
    patients = [None if by_slide else tcga_patient(slide) for slide in slides]
    if all(patient is None for patient in patients):
        return Groups(GroupKind.SLIDE, slides, slides)
    names = tuple(patient or slide for patient, slide in zip(patients, slides, strict=True))
    own = {slide for patient, slide in zip(patients, slides, strict=True) if patient is None}
    return Groups(GroupKind.PATIENT, names, slides, ORIGIN, len(own))


def barcoded_tiles(dataset: TileFolderDataset) -> Groups | None:
    """A tile folder where some names carry no slide: the tiles named by a TCGA barcode grouped by patient, those of
    other slides by slide, the rest each alone (its path); None when no name is a TCGA barcode."""
    slides = default_slides(dataset.files)
    if not any(slide is not None and tcga_patient(slide) is not None for slide in slides):
        return None
    own = tuple(slide if slide is not None else str(path.relative_to(dataset.root))
                for slide, path in zip(slides, dataset.files, strict=True))
    check_one_class_per_slide(dataset, own, None)
    groups = named_slides(own, False)
    alone = frozenset(name for name, slide in zip(own, slides, strict=True) if slide is None)
    return replace(groups, own_slides=groups.own_slides - len(alone), alone=alone)


def check_one_class_per_slide(dataset: TileFolderDataset, slides: Sequence[str], pattern: str | None) -> None:
    """ConfigError naming a slide whose tiles lie in two class folders (its tiles would be merged into one slide of
    two labels), the folders, and how many slides more."""
    labels: dict[str, set[int]] = {}
    for slide, label in zip(slides, dataset.labels, strict=True):
        labels.setdefault(slide, set()).add(label)
    mixed = [(slide, sorted(found)) for slide, found in labels.items() if len(found) > 1]
    if not mixed:
        return
    slide, found = mixed[0]
    folders = " and ".join(f"{dataset.root / dataset.classes[label]}/" for label in found)
    more = f" ({len(mixed) - 1} more slides so)" if len(mixed) > 1 else ""
    knob = KNOB if pattern is not None and pattern != BY_SLIDE else "--datapath"
    raise ConfigError(knob, f"slide {slide!r} has tiles in {folders}{more}: a slide has one label; rename the "
                            f"slide's tiles in one of the folders, or give {KNOB} REGEX whose first group names each "
                            f"slide")


def tile_slides(files: Sequence[Path], pattern: str | None) -> tuple[str, ...] | None:
    """The slide of every tile file by ``pattern`` (ConfigError naming a file it misses), or by the first default
    pattern each file matches (a TCGA slide id before ``<slide>_<x>_<y>``; None: a file matches none)."""
    if pattern is not None:
        regex = compile_pattern(pattern)
        names = [slide_name(regex, f) for f in files]
        missed = [f for f, n in zip(files, names, strict=True) if n is None]
        if missed:
            raise ConfigError(KNOB, f"{pattern!r} does not match {len(missed)} of {len(files)} tile names, e.g. "
                                    f"{missed[0].stem!r}; give a regex whose first group names the slide")
        return tuple(n for n in names if n is not None)
    found = default_slides(files)
    if any(n is None for n in found):
        return None
    return tuple(n for n in found if n is not None)


def default_slides(files: Sequence[Path]) -> list[str | None]:
    """The slide of each tile file by the first default pattern it matches (None: none does)."""
    defaults = [re.compile(default) for default in DEFAULT_PATTERNS]
    return [next((n for regex in defaults if (n := slide_name(regex, f)) is not None), None) for f in files]


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """``--group-by``'s regex (with at least one group); ConfigError otherwise."""
    try:
        regex = re.compile(pattern)
    except re.error as err:
        raise ConfigError(KNOB, f"{pattern!r} is not a regular expression ({err})") from err
    if regex.groups < 1:
        raise ConfigError(KNOB, f"{pattern!r} has no group; put the slide's part in parentheses, e.g. "
                                f"'(.+)_\\d+_\\d+'")
    return regex


def slide_name(regex: re.Pattern[str], path: Path) -> str | None:
    """The slide ``regex``'s first group names in ``path``'s name without suffix (whole match; None: none)."""
    match = regex.fullmatch(path.stem) or regex.match(path.stem)
    return match.group(1) if match is not None and match.group(1) else None
