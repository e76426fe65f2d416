"""Held-out split: stratified, deterministic, refused outside (0, 1) or with fewer samples than classes."""
from __future__ import annotations

import pytest

from mpi4dl_nb.data import SyntheticDataset
from mpi4dl_nb.data.groups import GroupKind, Groups
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.evaluation.grouped import split_grouped
from mpi4dl_nb.evaluation.split import Subset, split_listing, stratified_split

LABELS = [0] * 40 + [1] * 20 + [2] * 8 + [3]


def test_split_is_stratified_disjoint_and_complete():
    train, val = stratified_split(LABELS, 0.25, seed=7, num_classes=4)
    assert sorted(train + val) == list(range(len(LABELS))) and not set(train) & set(val)
    held = [LABELS[i] for i in val]
    assert [held.count(c) for c in range(4)] == [10, 5, 2, 0]     # a single sample stays in training
    assert val == sorted(val) and train == sorted(train)


def test_split_is_deterministic_and_seeded():
    assert stratified_split(LABELS, 0.3, 1, 4) == stratified_split(list(LABELS), 0.3, 1, 4)
    assert stratified_split(LABELS, 0.3, 1, 4)[1] != stratified_split(LABELS, 0.3, 2, 4)[1]


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_fraction_outside_open_interval_refused(fraction):
    with pytest.raises(ConfigError, match="--val-fraction.*strictly between 0 and 1"):
        stratified_split(LABELS, fraction, 0, 4)


def test_fewer_validation_samples_than_classes_refused():
    with pytest.raises(ConfigError, match="fewer than the 4 classes"):
        stratified_split([0, 0, 1, 1, 2, 2], 0.2, 0, 4)


def test_subset_reads_through_and_lists_its_images():
    data = SyntheticDataset(8, 2, 10, seed=0)
    sub = Subset(data, [3, 5])
    assert len(sub) == 2 and sub.label(1) == data.label(5) and sub.image_size == 8
    assert (sub.read(0, (0, 4, 0, 4)) == data.read(3, (0, 4, 0, 4))).all()
    assert split_listing(data, [3, 5]) == [[3, 5], [data.label(3), data.label(5)]]


# ----------------------------------------------------------------- grouped (leak-free) split
def test_grouped_split_keeps_each_group_on_one_side_and_stratifies_by_group():
    from mpi4dl_nb.evaluation.split import grouped_split

    groups = [f"p{i // 5}" for i in range(60)]             # 12 groups of 5 images
    labels = [int(g[1:]) % 2 for g in groups]               # 6 groups per class
    train, val = grouped_split(labels, groups, 0.34, seed=3, num_classes=2)
    assert sorted(train + val) == list(range(60))
    assert not {groups[i] for i in train} & {groups[i] for i in val}
    held = {groups[i] for i in val}
    assert sorted(int(g[1:]) % 2 for g in held) == [0, 0, 1, 1]    # round(0.34 * 6) = 2 groups of each class
    assert grouped_split(labels, groups, 0.34, 3, 2) == (train, val)
    assert grouped_split(labels, groups, 0.34, 4, 2) != (train, val)


def test_one_group_per_image_is_the_per_class_split():
    from mpi4dl_nb.evaluation.split import grouped_split

    assert grouped_split(LABELS, list(range(len(LABELS))), 0.25, 7, 4) == stratified_split(LABELS, 0.25, 7, 4)


def test_a_group_is_stratified_by_its_most_frequent_label():
    from mpi4dl_nb.evaluation.split import group_label

    assert group_label([1, 0, 1]) == 1 and group_label([2, 1]) == 1


def test_tile_names_give_the_slide_and_group_by_overrides(tmp_path):
    from pathlib import Path

    from mpi4dl_nb.data.groups import GroupKind, tile_slides

    names = [Path(f"{s}_{x}_{y}.png") for s in ("s1", "slide_2") for x in (0, 64) for y in (0, 64)]
    assert tile_slides(names, None) == ("s1",) * 4 + ("slide_2",) * 4
    tcga = [Path("TCGA-A1-A0SB-01Z-00-DX1.C1D2_tile3.png"), Path("TCGA-A1-A0SB-01Z-00-DX2.aa_tile1.png")]
    assert tile_slides(tcga, None) == ("TCGA-A1-A0SB-01Z-00-DX1", "TCGA-A1-A0SB-01Z-00-DX2")
    assert tile_slides([Path("a.png"), Path("b.png")], None) is None          # no default matches: ungrouped
    assert tile_slides([Path("caseA-t1.png")], r"case(\w)-t\d+") == ("A",)
    with pytest.raises(ConfigError, match="--group-by.*does not match 1 of 2.*'zz'"):
        tile_slides([Path("caseA-t1.png"), Path("zz.png")], r"case(\w)-t\d+")
    with pytest.raises(ConfigError, match="--group-by.*has no group"):
        tile_slides(names, r".+")
    assert GroupKind.UNGROUPED.plural == "images" and GroupKind.PATIENT.plural == "patients"


def test_split_dataset_takes_groups_and_keeps_its_old_signature():
    import mpi4dl_nb as dl

    data = SyntheticDataset(8, 2, 24, seed=0)
    old_train, old_val = dl.split_dataset(data, 0.25, 1)
    assert old_val.indices == stratified_split([data.label(i) for i in range(24)], 0.25, 1, 2)[1]
    patients = [f"p{i % 6}" for i in range(24)]
    train, val = dl.split_dataset(data, 0.25, seed=1, groups=patients)
    assert sorted(train.indices + val.indices) == list(range(24))
    assert not {patients[i] for i in train.indices} & {patients[i] for i in val.indices}


def test_group_folds_partition_the_groups_stratified_and_seeded():
    from mpi4dl_nb.evaluation.split import fold_split, group_folds

    groups = [f"p{i // 3}" for i in range(36)]              # 12 groups of 3 images, 6 per class
    labels = [int(g[1:]) % 2 for g in groups]
    folds = group_folds(labels, groups, 3, seed=5)
    assert sorted(folds) == sorted(set(groups)) and set(folds.values()) == {0, 1, 2}
    for fold in range(3):
        members = [g for g, f in folds.items() if f == fold]
        assert sorted(int(g[1:]) % 2 for g in members) == [0, 0, 1, 1]     # 2 groups of each class per fold
        train, val = fold_split(groups, folds, fold)
        assert sorted(train + val) == list(range(36))
        assert not {groups[i] for i in train} & {groups[i] for i in val}
    assert group_folds(labels, groups, 3, seed=5) == folds and group_folds(labels, groups, 3, seed=6) != folds
    with pytest.raises(ConfigError, match="--folds: 13 folds of 12 groups"):
        group_folds(labels, groups, 13, 0)


def test_a_class_left_without_images_on_a_side_is_refused_naming_it():
    labels = [0, 0, 0, 0, 1, 1]                       # class 1: both slides of one patient
    groups = Groups(GroupKind.PATIENT, ("p1", "p1", "p2", "p3", "p4", "p4"), ("a", "b", "c", "d", "e", "f"))
    split = split_grouped(labels, groups, 0.5, 0, 2)
    with pytest.raises(ConfigError, match=r"no images of class 'tumour' on the val side .* add patients"):
        split.check_classes(labels, ("normal", "tumour"))
    both = Groups(GroupKind.PATIENT, ("p1", "p1", "p2", "p3", "p4", "p5"), ("a", "b", "c", "d", "e", "f"))
    split_grouped(labels, both, 0.5, 0, 2).check_classes(labels, ("normal", "tumour"))   # a patient on each side
