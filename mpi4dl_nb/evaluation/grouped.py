"""A dataset's leak-free held-out split: whole groups (patients, slides) on one side, the groups of each side,
and the counts a run prints (groups, slides, images per class per side)."""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from ..data.dataset import RegionDataset
from ..data.groups import GroupKind, Groups
from ..data.manifest import Side
from ..errors import ConfigError
from .split import Subset, fold_split, group_folds, grouped_split


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

    def check_classes(self, labels: Sequence[int], class_names: Sequence[str], knob: str = "--val-fraction") -> None:
        """ConfigError naming every class with no image on one side (a class of one patient or slide cannot be on
        both sides; training would not see it, or no figure could score it)."""
        found = set(labels)
        empty = [f"{name!r} on the {side} side" for c, name in enumerate(class_names) if c in found
                 for side, indices in (("train", self.train), ("val", self.val))
                 if not any(labels[i] == c for i in indices)]
        if empty:
            kind = self.groups.kind.plural
            lone = lone_groups(labels, self.groups)
            alone = [f"class {name!r} is all {self.groups.kind.value} {lone[c]}" for c, name in enumerate(class_names)
                     if c in lone]
            cause = f"{'; '.join(alone)}, never split" if alone else f"its {kind} are too few to put on both sides"
            raise ConfigError(knob, f"the split leaves no images of class {', '.join(empty)} ({cause}); add {kind} "
                                    f"of that class{group_by_slide(self.groups)}, change --val-fraction or --folds, "
                                    f"or --seed")

    def summary(self, labels: Sequence[int], class_names: Sequence[str]) -> str:
        """One line per side: its groups, slides and images per class; ungrouped splits say so."""
        kind = self.groups.kind
        head = ("ungrouped: tiles split one by one (no patient or slide known; --cohort or --group-by REGEX "
                "groups them)" if kind is GroupKind.UNGROUPED else self.groups.heading)
        lines = [f"held-out split {head}"]
        for side, indices in (("train", self.train), ("val", self.val)):
            lines.append(f"  {side}: {self.side_counts(indices, labels, class_names)}")
        return "\n".join(lines)

    def side_counts(self, indices: Sequence[int], labels: Sequence[int], class_names: Sequence[str]) -> str:
        per_class = ", ".join(f"{name} {sum(1 for i in indices if labels[i] == c)}"
                              for c, name in enumerate(class_names))
        parts = self.groups.side_parts(indices)
        return ", ".join([*parts, f"{len(indices)} images" + (f" ({per_class})" if per_class else "")])


def lone_groups(labels: Sequence[int], groups: Groups) -> dict[int, str]:
    """The classes whose images are all of one group (a patient, a slide), with that group (none when ungrouped)."""
    members: dict[int, set[str]] = {}
    for label, name in zip(labels, groups.names, strict=True):
        members.setdefault(int(label), set()).add(name)
    return {} if groups.kind is GroupKind.UNGROUPED else {c: min(n) for c, n in members.items() if len(n) == 1}


def group_by_slide(groups: Groups) -> str:
    """The way out a split by patient has beside more patients: ``--group-by slide`` (empty for other groups)."""
    return ", or pass --group-by slide to hold out whole slides (a patient's slides may then lie on both sides)" \
        if groups.kind is GroupKind.PATIENT else ""


def split_grouped(labels: Sequence[int], groups: Groups, fraction: float, seed: int, num_classes: int,
                  class_names: Sequence[str] = ()) -> GroupedSplit:
    """The seeded split holding out a share ``fraction`` of the groups of each class (``grouped_split``); a split
    that holds out too little because a class (or the whole data) is one patient or slide is refused naming it."""
    try:
        train, val = grouped_split(labels, groups.names, fraction, seed, num_classes)
    except ConfigError as err:
        lone = lone_groups(labels, groups)
        if not lone or not 0.0 < fraction < 1.0:
            raise
        kind, names = groups.kind.value, sorted(set(groups.names))
        which = (f"every image is of one {kind}, {names[0]}" if len(names) == 1 else "; ".join(
            f"class {class_names[c] if c < len(class_names) else c} is all {kind} {group}"
            for c, group in sorted(lone.items())))
        raise ConfigError(err.knob, f"{which}, and a {kind} is never split across the sides, so none can be held "
                                    f"out at any fraction; add images of other {kind}s{group_by_slide(groups)}") \
            from None
    return GroupedSplit(groups, tuple(train), tuple(val))


def split_fold(labels: Sequence[int], groups: Groups, folds: int, fold: int, seed: int,
               given: dict[str, int] | None = None) -> GroupedSplit:
    """Fold ``fold`` of a grouped stratified ``folds``-fold split (``given``: each group's fold, e.g. a manifest's
    ``fold`` column, instead of dealt ones); ConfigError for a fold outside 0..folds-1 or an empty side."""
    if not 0 <= fold < folds:
        raise ConfigError("--fold", f"{fold} is not one of the folds 0..{folds - 1} of --folds {folds}")
    folds_of: dict[Hashable, int] = ({k: v for k, v in given.items()} if given
                                     else group_folds(labels, groups.names, folds, seed))
    beyond = sorted({f for f in folds_of.values() if not 0 <= f < folds})
    if beyond:
        raise ConfigError("--folds", f"{folds} folds, but the manifest's fold column has {beyond[0]}; give --folds "
                                     f"{max(folds_of.values()) + 1}")
    train, val = fold_split(groups.names, folds_of, fold)
    if not train or not val:
        raise ConfigError("--fold", f"fold {fold} of {folds} leaves {'no training' if not train else 'no held-out'} "
                                    f"images; give more groups or fewer folds")
    return GroupedSplit(groups, tuple(train), tuple(val))


def split_by_side(groups: Groups, sides: Mapping[str, Side | None]) -> GroupedSplit:
    """The split a manifest's ``split`` column gives (``sides``: each group's side): ``train`` groups trained on,
    ``val`` groups held out, ``test`` groups in neither; ConfigError for an empty side."""
    train = tuple(i for i, g in enumerate(groups.names) if sides.get(g) is Side.TRAIN)
    val = tuple(i for i, g in enumerate(groups.names) if sides.get(g) is Side.VAL)
    if not train or not val:
        raise ConfigError("--cohort", f"its split column puts no slide on the {'train' if not train else 'val'} side; "
                                      f"give some patients that side, or drop the column and use --val-fraction")
    return GroupedSplit(groups, train, val)
