"""data/classes.py: class names from folders or --classes, --num-classes checked against the data, class weights."""
from __future__ import annotations

import pytest

from mpi4dl_nb.data import SyntheticDataset, TileFolderDataset
from mpi4dl_nb.data.cifar import CLASSES as CIFAR
from mpi4dl_nb.data.classes import (
    class_counts,
    class_weights,
    folder_classes,
    parse_class_weights,
    parse_names,
    resolve_names,
)
from mpi4dl_nb.errors import ConfigError
from tests.support.bad_data import write_tiles


def test_folder_names_are_the_classes_and_a_disagreeing_count_is_refused(tmp_path):
    write_tiles(tmp_path, per_class=2, classes=("tumour", "benign"))
    found = folder_classes("medical", tmp_path)
    assert found == ("benign", "tumour")
    assert resolve_names("medical", found, None, None) == found
    assert resolve_names("medical", found, None, 2) == found
    with pytest.raises(ConfigError, match=r"--num-classes: .* has 2 classes \(benign, tumour\), not 3; "
                                          r"use --num-classes 2"):
        resolve_names("medical", found, None, 3)
    assert folder_classes("medical", tmp_path / "benign") == ("",)      # files directly in the folder
    assert folder_classes("synthetic", None) is None and folder_classes("cifar", tmp_path) == CIFAR
    with pytest.raises(ConfigError, match="--datapath.*does not exist"):
        folder_classes("medical", tmp_path / "gone")


def test_an_empty_class_folder_is_refused_naming_it(tmp_path):
    write_tiles(tmp_path, per_class=2, classes=("a", "b"))
    (tmp_path / "c").mkdir()
    (tmp_path / ".ipynb_checkpoints").mkdir()                      # hidden folders are no classes
    with pytest.raises(ConfigError, match=r"--datapath: class folder .*/c holds no images"):
        folder_classes("medical", tmp_path)
    (tmp_path / "c").rmdir()
    assert folder_classes("medical", tmp_path) == ("a", "b")
    with pytest.raises(ValueError, match=r"class folder .*/z holds no images"):
        TileFolderDataset(tmp_path, 8, classes=("a", "b", "z"))


def test_given_names_order_the_labels_and_must_match_the_folders(tmp_path):
    write_tiles(tmp_path, per_class=2, classes=("a", "b"))
    found = ("a", "b")
    assert resolve_names("medical", found, ("b", "a"), None) == ("b", "a")
    with pytest.raises(ConfigError, match="--classes: .*class folder.* b .*--classes a,b"):
        resolve_names("medical", found, ("a",), None)
    with pytest.raises(ConfigError, match="--classes: c: no such class folder"):
        resolve_names("medical", found, ("a", "b", "c"), None)
    natural = TileFolderDataset(tmp_path, 32)
    swapped = TileFolderDataset(tmp_path, 32, classes=("b", "a"))
    assert swapped.classes == ["b", "a"]
    assert [swapped.label(i) for i in range(4)] == [1 - natural.label(i) for i in range(4)]
    with pytest.raises(ValueError, match="'b'.*not among the classes a, c"):
        TileFolderDataset(tmp_path, 32, classes=("a", "c"))
    with pytest.raises(ValueError, match="has 2 classes but --num-classes is 3"):
        TileFolderDataset(tmp_path, 32, num_classes=3)


def test_data_without_named_classes():
    assert resolve_names("synthetic", None, None, None) == tuple(str(c) for c in range(10))
    assert resolve_names("synthetic", None, None, 3) == ("0", "1", "2")
    assert resolve_names("synthetic", None, ("x", "y"), None) == ("x", "y")
    with pytest.raises(ConfigError, match="--classes: names 2 classes but --num-classes is 3"):
        resolve_names("synthetic", None, ("x", "y"), 3)
    assert resolve_names("cifar", CIFAR, None, None) == CIFAR
    with pytest.raises(ConfigError, match="CIFAR-10's classes"):
        resolve_names("cifar", CIFAR, tuple(reversed(CIFAR)), None)
    assert parse_names(" benign, tumour ") == ("benign", "tumour") and parse_names(None) is None
    for bad in ("a,,b", "a,b,a"):
        with pytest.raises(ConfigError, match="--classes"):
            parse_names(bad)


def test_class_weights_balanced_or_given():
    dataset = SyntheticDataset(8, 3, 40, seed=2)
    counts = class_counts(dataset, 3)
    assert sum(counts) == 40 and counts == [sum(dataset.label(i) == c for i in range(40)) for c in range(3)]
    weights = class_weights("balanced", counts)
    assert weights == pytest.approx([40 / (3 * n) for n in counts])
    assert sum(w * n for w, n in zip(weights, counts)) == pytest.approx(40)     # the mean weight per image is 1
    assert class_weights("balanced", [6, 0, 2]) == pytest.approx([8 / 12, 0.0, 8 / 4])
    assert class_weights((1.0, 2.0, 3.0), counts) == (1.0, 2.0, 3.0)
    with pytest.raises(ConfigError, match="2 weights for 3 classes"):
        class_weights((1.0, 2.0), counts)
    assert parse_class_weights("Balanced") == "balanced" and parse_class_weights("1, 0.5") == (1.0, 0.5)
    for bad in ("1,x", "-1,2", "0,0", "inf,1", "nan,1"):
        with pytest.raises(ConfigError, match="--class-weights"):
            parse_class_weights(bad)
