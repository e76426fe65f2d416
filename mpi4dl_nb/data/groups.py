"""Which slide or patient each image comes from: the groups a leak-free held-out split keeps on one side.

Tiles cut from slides by this package know their slide; tile folders exported by other tools say it in their
file names. Found, in order: ``--group-by REGEX`` (its first group names the group), a TCGA barcode
(``TCGA-XX-XXXX``: the patient), ``<slide>_<x>_<y>`` (the slide, as QuPath and most tilers name tiles).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..config import Choice, ConfigError
from .dataset import RegionDataset

TCGA_PATIENT = re.compile(r"(TCGA-[A-Z0-9]{2}-[A-Z0-9]{4})", re.IGNORECASE)
TILE_OF_SLIDE = re.compile(r"^(.+?)[_-]\D{0,2}\d+[_-]\D{0,2}\d+$")   # <slide>_<x>_<y>, <slide>_x12_y34, ...


class GroupKind(Choice):
    """What a split's groups are."""

    PATIENT = "patient"
    SLIDE = "slide"
    PATTERN = "group-by"
    NONE = "ungrouped"


@dataclass(frozen=True)
class Groups:
    """The group of each image (``keys[i]``; None: each image its own group) and what the groups are."""

    kind: GroupKind
    keys: tuple[str, ...] | None = None
    why_not: str = ""          # why the images are not grouped (kind NONE)

    @property
    def grouped(self) -> bool:
        return self.keys is not None

    def describe(self) -> str:
        """``grouped by slide (6 slides)`` or ``ungrouped: images split one by one (why)``."""
        if self.keys is None:
            return f"ungrouped: images split one by one ({self.why_not})"
        plural = "patients" if self.kind is GroupKind.PATIENT else f"{self.kind}s"
        return f"grouped by {self.kind} ({len(set(self.keys))} {plural})"


def group_pattern(text: str | None) -> re.Pattern[str] | None:
    """``--group-by``'s regular expression (None: not given); ConfigError when it does not compile or has no group."""
    if text is None:
        return None
    try:
        pattern = re.compile(text)
    except re.error as err:
        raise ConfigError("--group-by", f"{text!r} is not a regular expression: {err}") from None
    if pattern.groups < 1:
        raise ConfigError("--group-by", f"{text!r} has no group: put the slide or patient part in parentheses, "
                          r"e.g. '^(.+?)_\d+_\d+'")
    return pattern


def name_group(stem: str, pattern: re.Pattern[str] | None) -> tuple[GroupKind, str] | None:
    """The group a file name (without suffix) names, and of what kind (None: it names none)."""
    if pattern is not None:
        found = pattern.search(stem)
        return (GroupKind.PATTERN, found.group(1)) if found and found.group(1) else None
    barcode = TCGA_PATIENT.search(stem)
    if barcode:
        return GroupKind.PATIENT, barcode.group(1).upper()
    tile = TILE_OF_SLIDE.match(stem)
    return (GroupKind.SLIDE, tile.group(1)) if tile else None


def groups_of_names(paths: Sequence[Path], pattern: re.Pattern[str] | None = None) -> Groups:
    """Groups from file names: every name must say its group (one that does not leaves the images ungrouped)."""
    named = [name_group(Path(p).stem, pattern) for p in paths]
    pairs = [found for found in named if found is not None]
    if not paths or len(pairs) < len(paths):
        missing = [Path(p).name for p, found in zip(paths, named) if found is None]
        rule = "--group-by" if pattern is not None else "<slide>_<x>_<y> or a TCGA barcode"
        return Groups(GroupKind.NONE, why_not=f"{len(missing)} file names such as {missing[0] if missing else '-'} "
                                              f"do not say their slide ({rule})")
    kinds = {kind for kind, _ in pairs}
    return Groups(next(iter(kinds)) if len(kinds) == 1 else GroupKind.SLIDE, tuple(key for _, key in pairs))


def groups_of_slides(slide_of_tile: Sequence[int], slides: Sequence[Path]) -> Groups:
    """Groups of tiles cut from ``slides``: the patient when every slide name carries a TCGA barcode, else the slide."""
    barcodes = [TCGA_PATIENT.search(Path(slide).stem) for slide in slides]
    patients = [found.group(1).upper() for found in barcodes if found is not None]
    if len(patients) == len(slides):
        return Groups(GroupKind.PATIENT, tuple(patients[n] for n in slide_of_tile))
    return Groups(GroupKind.SLIDE, tuple(str(slides[n]) for n in slide_of_tile))


def dataset_groups(dataset: RegionDataset, pattern: re.Pattern[str] | None = None) -> Groups:
    """The groups of ``dataset``'s images: its slides' tiles, its files' names, or none (generated data)."""
    from .annotated_slides import AnnotatedSlideDataset
    from .pathology import SlideDataset

    slides = dataset.slides if isinstance(dataset, AnnotatedSlideDataset) else dataset
    if isinstance(slides, SlideDataset):
        if pattern is not None:
            return groups_of_names([slides.paths[t.slide] for t in slides.tiles], pattern)
        return groups_of_slides([t.slide for t in slides.tiles], slides.paths)
    files = getattr(dataset, "files", None)
    if isinstance(files, list) and len(files) == len(dataset):
        return groups_of_names(files, pattern)
    return Groups(GroupKind.NONE, why_not=f"{type(dataset).__name__} images come from no slide")
