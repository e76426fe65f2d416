"""The group of each image a held-out split keeps on one side: its patient, else its slide (tiles cut from one
slide, or tile files whose names carry the slide), else nothing (ungrouped: the image alone)."""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from ..errors import ConfigError
from .dataset import RegionDataset

KNOB = "--group-by"
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

    def __len__(self) -> int:
        return len(self.names)


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
    """The groups of ``dataset``'s images: a cohort's patients, a slide dataset's slides, tile files' slides by
    ``pattern`` (``--group-by REGEX``, first group the slide; None: the default patterns when every file matches
    one), else ungrouped. ConfigError for a ``pattern`` that is no regex or does not match a file."""
    from .canvas import SlideCanvases
    from .cohort_slides import CohortSlides
    from .pathology import SlideDataset, TileFolderDataset

    if isinstance(dataset, SlideCanvases):            # a sample per slide
        kind = GroupKind.SLIDE if dataset.patients == dataset.names else GroupKind.PATIENT
        return Groups(kind, tuple(dataset.patients), tuple(dataset.names))
    if isinstance(dataset, SlideDataset):
        slides = tuple(dataset.paths[t.slide].stem for t in dataset.tiles)
        if not isinstance(dataset, CohortSlides):
            return Groups(GroupKind.SLIDE, slides, slides)
        return Groups(GroupKind.PATIENT, tuple(dataset.patients[t.slide] for t in dataset.tiles), slides)
    if isinstance(dataset, TileFolderDataset):
        found = tile_slides(dataset.files, pattern)
        if found is not None:
            return Groups(GroupKind.SLIDE, found, found)
    elif pattern is not None:
        raise ConfigError(KNOB, f"groups tile files by name; this data ({type(dataset).__name__}) has none; drop "
                                f"{KNOB}")
    return ungrouped(len(dataset))


def tile_slides(files: Sequence[Path], pattern: str | None) -> tuple[str, ...] | None:
    """The slide of every tile file by ``pattern`` (ConfigError naming a file it misses), or by the first default
    pattern matching every file (None: none does)."""
    if pattern is not None:
        regex = compile_pattern(pattern)
        names = [slide_name(regex, f) for f in files]
        missed = [f for f, n in zip(files, names, strict=True) if n is None]
        if missed:
            raise ConfigError(KNOB, f"{pattern!r} does not match {len(missed)} of {len(files)} tile names, e.g. "
                                    f"{missed[0].stem!r}; give a regex whose first group names the slide")
        return tuple(n for n in names if n is not None)
    for default in DEFAULT_PATTERNS:
        regex = re.compile(default)
        found = [slide_name(regex, f) for f in files]
        if all(n is not None for n in found):
            return tuple(n for n in found if n is not None)
    return None


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
