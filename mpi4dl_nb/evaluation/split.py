"""Held-out data: a seeded stratified split of a dataset, subsets with region reads, the split's fingerprint."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..data.dataset import Box, RegionDataset
from ..data.masks import MaskDataset
from ..errors import ConfigError


def stratified_split(labels: Sequence[int], fraction: float, seed: int,
                     num_classes: int) -> tuple[list[int], list[int]]:
    """(train indices, validation indices), both ascending: a share ``fraction`` of each class held out.

    Deterministic in (labels, fraction, seed): class ``c``'s indices are shuffled by a
    generator seeded with ``(seed, c)`` and the first ``round(fraction * n_c)`` go to
    validation (at least one when the class has two or more samples, never all of them).
    ConfigError for ``fraction`` outside (0, 1) or fewer validation samples than classes.
    """
    if not (0.0 < fraction < 1.0):
        raise ConfigError("--val-fraction", f"must lie strictly between 0 and 1, got {fraction:g}")
    labels = [int(v) for v in labels]
    train: list[int] = []
    val: list[int] = []
    for c in sorted(set(labels)):
        members = np.array([i for i, v in enumerate(labels) if v == c], dtype=np.int64)
        members = members[np.random.default_rng([seed, c]).permutation(len(members))]
        take = int(round(fraction * len(members)))
        take = min(max(take, 1 if len(members) > 1 else 0), len(members) - 1)
        val += members[:take].tolist()
        train += members[take:].tolist()
    if len(val) < num_classes:
        raise ConfigError("--val-fraction", f"{fraction:g} of {len(labels)} images holds out {len(val)}, "
                          f"fewer than the {num_classes} classes; raise --val-fraction or use more data")
    return sorted(train), sorted(val)


def grouped_split(labels: Sequence[int], groups: Sequence[str], fraction: float, seed: int,
                  num_classes: int) -> tuple[list[int], list[int]] | None:
    """(train indices, validation indices) with every group's images on one side: whole groups held out, a share
    ``fraction`` of each class's images as near as whole groups allow (a group counts for its commonest label).

    Deterministic in (labels, groups, fraction, seed): class ``c``'s groups, sorted, are shuffled by a generator
    seeded with ``(seed, c)`` and held out in that order while that brings the class's held-out images nearer
    the share (at least one group, never all of them). None when some class has a single group, or fewer
    held-out images than classes result: such data cannot be split by group.
    """
    members: dict[str, list[int]] = {}
    for index, key in enumerate(groups):
        members.setdefault(key, []).append(index)
    by_class: dict[int, list[str]] = {}
    for key in sorted(members):
        votes = [int(labels[i]) for i in members[key]]
        by_class.setdefault(max(sorted(set(votes)), key=votes.count), []).append(key)
    val: list[int] = []
    for c in sorted(by_class):
        keys = by_class[c]
        if len(keys) < 2:
            return None
        order = [keys[i] for i in np.random.default_rng([seed, c]).permutation(len(keys))]
        target = fraction * sum(len(members[k]) for k in keys)
        held = 0
        for taken, key in enumerate(order[:-1]):
            size = len(members[key])
            if taken and abs(held + size - target) >= abs(held - target):
                break
            val += members[key]
            held += size
    if len(val) < num_classes:
        return None
    chosen = set(val)
    return [i for i in range(len(labels)) if i not in chosen], sorted(val)


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
