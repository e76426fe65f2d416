"""Held-out split: stratified, deterministic, refused outside (0, 1) or with fewer samples than classes."""
from __future__ import annotations

import pytest

from mpi4dl_nb.data import SyntheticDataset
from mpi4dl_nb.errors import ConfigError
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
