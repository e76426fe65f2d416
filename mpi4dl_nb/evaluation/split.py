"""Held-out data: a seeded stratified split of a dataset, subsets with region reads, the split's fingerprint."""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..data.dataset import Box, RegionDataset
from ..data.masks import MaskDataset
from ..errors import ConfigError


def stratified_split(labels: Sequence[int], fraction: float, seed: int,
                     num_classes: int) -> tuple[list[int], list[int]]:
    """(train indices, validation indices), both ascending: a share ``fraction`` of each class held out, image by
    image (``grouped_split`` with every image its own group)."""
    return grouped_split(labels, range(len(labels)), fraction, seed, num_classes)


def grouped_split(labels: Sequence[int], groups: Sequence[Hashable], fraction: float, seed: int,
                  num_classes: int) -> tuple[list[int], list[int]]:
    """(train indices, validation indices), both ascending: whole groups held out, a share ``fraction`` of the
    groups of each class, so that no group has images on both sides.

    A group's class is its images' most frequent label (ties: the smallest). Deterministic in (labels, groups,
    fraction, seed): class ``c``'s groups, in order of first appearance, are shuffled by a generator seeded with
    ``(seed, c)`` and the first ``round(fraction * n_c)`` go to validation (at least one when the class has two or
    more groups, never all of them). With one group per image this is the per-class split of images.
    ConfigError for ``fraction`` outside (0, 1) or fewer validation images than classes.
    """
    if not (0.0 < fraction < 1.0):
        raise ConfigError("--val-fraction", f"must lie strictly between 0 and 1, got {fraction:g}")
    labels = [int(v) for v in labels]
    if len(groups) != len(labels):
        raise ValueError(f"{len(groups)} groups for {len(labels)} labels")
    members: dict[Hashable, list[int]] = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    by_class: dict[int, list[Hashable]] = {}
    for group, indices in members.items():
        by_class.setdefault(group_label([labels[i] for i in indices]), []).append(group)
    held: list[Hashable] = []
    for c in sorted(by_class):
        ordered = by_class[c]
        shuffled = [ordered[i] for i in np.random.default_rng([seed, c]).permutation(len(ordered))]
        take = int(round(fraction * len(shuffled)))
        held += shuffled[:min(max(take, 1 if len(shuffled) > 1 else 0), len(shuffled) - 1)]
    val = sorted(i for g in held for i in members[g])
    chosen = set(val)
    if len(val) < num_classes:
        raise ConfigError("--val-fraction", f"{fraction:g} of {len(labels)} images holds out {len(val)}, "
                          f"fewer than the {num_classes} classes; raise --val-fraction or use more data")
    return [i for i in range(len(labels)) if i not in chosen], val


def group_folds(labels: Sequence[int], groups: Sequence[Hashable], folds: int, seed: int) -> dict[Hashable, int]:
    """Each group's fold (0 .. ``folds`` - 1): stratified K-fold of whole groups. Class by class (a group's class
    as in ``grouped_split``), its groups shuffled by a generator seeded with ``(seed, c)`` are dealt to the folds
    in turn, the turn going on from class to class so the folds differ in size by one group at most.
    ConfigError for fewer groups than folds."""
    members: dict[Hashable, list[int]] = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(int(labels[index]))
    if folds < 2 or len(members) < folds:
        raise ConfigError("--folds", f"{folds} folds of {len(members)} groups (patients, slides or images): give "
                                     f"2 <= --folds <= {len(members)}")
    by_class: dict[int, list[Hashable]] = {}
    for group, group_labels in members.items():
        by_class.setdefault(group_label(group_labels), []).append(group)
    assigned: dict[Hashable, int] = {}
    turn = 0
    for c in sorted(by_class):
        ordered = by_class[c]
        for i in np.random.default_rng([seed, c]).permutation(len(ordered)):
            assigned[ordered[i]] = turn % folds
            turn += 1
    return assigned


def fold_split(groups: Sequence[Hashable], folds_of: dict[Hashable, int], fold: int) -> tuple[list[int], list[int]]:
    """(train indices, validation indices): the images of the groups in fold ``fold`` held out."""
    val = [i for i, g in enumerate(groups) if folds_of[g] == fold]
    held = set(val)
    return [i for i in range(len(groups)) if i not in held], val


def group_label(labels: Sequence[int]) -> int:
    """The label a group is stratified by: its most frequent one (ties: the smallest)."""
    return min(set(labels), key=lambda v: (-labels.count(v), v))


@dataclass
class Subset:
    """Some images of a dataset (``indices``), read through it: a RegionDataset itself."""

    dataset: RegionDataset
    indices: list[int]
    image_size: int = field(init=False)
    channels: int = field(init=False)
    num_classes: int = field(init=False)

    def __post_init__(self) -> None:
        self.image_size = self.dataset.image_size
        self.channels = self.dataset.channels
        self.num_classes = self.dataset.num_classes

    def __len__(self) -> int:
        return len(self.indices)

    def label(self, index: int) -> int:
        return self.dataset.label(self.indices[index])

    def read(self, index: int, box: Box | None = None) -> torch.Tensor:
        return self.dataset.read(self.indices[index], box)

    def read_mask(self, index: int, box: Box | None = None) -> torch.Tensor:
        """The mask of image ``index`` (a MaskDataset's subset; TypeError otherwise)."""
        if not isinstance(self.dataset, MaskDataset):
            raise TypeError(f"{type(self.dataset).__name__} has no masks")
        return self.dataset.read_mask(self.indices[index], box)


def item_names(dataset: RegionDataset, indices: Sequence[int]) -> list[list[str]] | list[int]:
    """What names the images ``indices``: their files when the dataset has one file per image, else positions."""
    files = getattr(dataset, "files", None) or getattr(dataset, "paths", None)
    if files is not None and len(files) == len(dataset):
        return [str(files[i]).rsplit("/", 2)[-2:] for i in indices]
    return list(indices)


def split_listing(dataset: RegionDataset, indices: Sequence[int]) -> list[list[list[str]] | list[int]]:
    """What the validation images are (names and labels): the value the run identity hashes."""
    return [item_names(dataset, indices), [dataset.label(i) for i in indices]]
