"""A dataset's leak-free held-out split: whole groups (patients, slides) on one side, the groups of each side,
and the counts a run prints (groups, slides, images per class per side)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..data.dataset import RegionDataset
from ..data.groups import GroupKind, Groups
from .split import Subset, grouped_split


@dataclass(frozen=True)
class GroupedSplit:
    """The two sides of a split (image indices, ascending) and the groups of the dataset's images."""

    groups: Groups
    train: tuple[int, ...]
    val: tuple[int, ...]

    def side_groups(self, indices: Sequence[int]) -> tuple[str, ...]:
        """The groups of the images ``indices``, sorted."""
        return tuple(sorted({self.groups.names[i] for i in indices}))

    def subsets(self, dataset: RegionDataset) -> tuple[Subset, Subset]:
        """(training images, held-out images) of ``dataset``."""
        return Subset(dataset, list(self.train)), Subset(dataset, list(self.val))

    def summary(self, labels: Sequence[int], class_names: Sequence[str]) -> str:
        """One line per side: its groups, slides and images per class; ungrouped splits say so."""
        kind = self.groups.kind
        head = ("ungrouped: tiles split one by one (no patient or slide known; --cohort or --group-by REGEX "
                "groups them)" if kind is GroupKind.UNGROUPED else f"grouped by {kind.value}")
        lines = [f"held-out split {head}"]
        for side, indices in (("train", self.train), ("val", self.val)):
            lines.append(f"  {side}: {self.side_counts(indices, labels, class_names)}")
        return "\n".join(lines)

    def side_counts(self, indices: Sequence[int], labels: Sequence[int], class_names: Sequence[str]) -> str:
        kind = self.groups.kind
        per_class = ", ".join(f"{name} {sum(1 for i in indices if labels[i] == c)}"
                              for c, name in enumerate(class_names))
        parts = [] if kind is GroupKind.UNGROUPED else [f"{len(self.side_groups(indices))} {kind.plural}"]
        if kind is GroupKind.PATIENT:
            parts.append(f"{len({self.groups.slides[i] for i in indices})} slides")
        return ", ".join([*parts, f"{len(indices)} images" + (f" ({per_class})" if per_class else "")])


def split_grouped(labels: Sequence[int], groups: Groups, fraction: float, seed: int,
                  num_classes: int) -> GroupedSplit:
    """The seeded split holding out a share ``fraction`` of the groups of each class (``grouped_split``)."""
    train, val = grouped_split(labels, groups.names, fraction, seed, num_classes)
    return GroupedSplit(groups, tuple(train), tuple(val))
