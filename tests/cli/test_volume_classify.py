"""``train --task classification --model resnet3d`` on class folders of volumes: 1x1x2 tiles and a layer rank equal
one process (float64); a volume smaller than the patch, an empty class folder, 2-D images and files outside class
folders refused before the first step, naming the file or the flag; a larger volume gives its centre patch."""
from __future__ import annotations

import json

import numpy as np
import pytest

from mpi4dl_nb.data.volume.classes import VolumeClassDataset
from mpi4dl_nb.data.volume.files import read_volume
from tests.support.battery import shared_job
from tests.support.requirements import VOLUMES_EXTRA, required_module
from tests.support.train_in_process import run_train
from tests.support.volume_data import write_volume_classes, write_volume_pairs

nibabel = required_module("nibabel", "volume CLI tests", VOLUMES_EXTRA)
tifffile = required_module("tifffile", "volume CLI tests", VOLUMES_EXTRA)

JOB = shared_job(3, "volume_cli_classify", timeout=120)
RESNET3D = ["--task", "classification", "--model", "resnet3d", "--num-filters", "2", "--image-size", "16,16,16",
            "--batch-size", "2", "--steps", "1", "--no-progress", "--split-size", "1", "--spatial-size", "0",
            "--dtype", "float64"]
SHAPE = (16, 16, 16)


@pytest.mark.parametrize("check", ["volume classes equal one process", "held-out volume classes equal one process",
                                   "each rank reads its tile"])
def test_classifying_volume_tiles_equals_one_process(shared_launch, check):
    """``--split-size 2 --spatial-size 1 --slice-method 1x1x2 --voxel-size 1 --val-fraction`` on 3 ranks (float64,
    2 steps): losses and every weight within 1e-9 of one process, the held-out loss and confusion matrix equal, each
    spatial rank reading only its tile of each volume file, the layer rank none (tests/mpi/volume_cli_classify.py)."""
    shared_launch(JOB).require([check])


def test_one_process_classifies_volumes_and_prints_accuracy(tmp_path, capsys):
    data = write_volume_classes(tmp_path / "v", shape=SHAPE, classes={"benign": ("a", "b", "e"),
                                                                      "tumour": ("c", "d", "f")})
    code, out, err = run_train([*RESNET3D, "--datapath", str(data), "--val-fraction", "0.34"], capsys)
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["classes"] == ["benign", "tumour"] and summary["volume_size"] == [16, 16, 16]
    assert summary["val_count"] == 2 and 0.0 <= summary["val_accuracy"] <= 1.0
    assert "train: 4 volume(s)" in err and "val: 2 volume(s)" in err
    assert "eval at step 1 (2 images): val_loss" in err and "val_accuracy" in err


def test_volumes_are_labelled_by_class_folder_in_the_order_of_classes(tmp_path):
    data = write_volume_classes(tmp_path / "v", shape=SHAPE)
    dataset = VolumeClassDataset.open(data, (8, 8, 8), classes=("tumour", "benign"))
    assert [p.name for p in dataset.files] == ["a.tif", "b.nii.gz", "c.tif", "d.nii.gz"]
    assert [dataset.label(i) for i in range(len(dataset))] == [1, 1, 0, 0]
    assert dataset.class_names == ("tumour", "benign") and dataset.subset([2]).label(0) == 0
    whole = read_volume(dataset.files[0]).astype(np.float64) / 65535   # a larger volume: its centre patch
    assert np.array_equal(dataset.read(0).numpy(), whole[:, 4:12, 4:12, 4:12].astype(np.float32))
    assert np.array_equal(dataset.read(0, ((0, 8), (0, 8), (4, 8))).numpy(), dataset.read(0).numpy()[..., 4:8])


def test_a_small_volume_and_flat_images_are_refused_naming_each_file(tmp_path, capsys):
    data = write_volume_classes(tmp_path / "v", shape=SHAPE)
    tifffile.imwrite(data / "benign" / "small.tif", np.zeros((16, 12, 16), np.uint16), imagej=True,
                     metadata={"axes": "ZYX"})
    tifffile.imwrite(data / "tumour" / "flat.tif", np.zeros((16, 16), np.uint16))                 # one page: 2-D
    (data / "tumour" / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    code, out, err = run_train([*RESNET3D, "--datapath", str(data)], capsys)
    assert code == 2 and out == "" and "3 of 7 files" in err, err
    assert "small.tif: is 16x12x16 voxels (DxHxW), smaller than --image-size 16,16,16; use --image-size 16,12,16" in err
    assert "flat.tif: a 2-D image (one page, shape (16, 16)), not a volume" in err
    assert "photo.png: not a volume file" in err


@pytest.mark.parametrize("change, flags, words", [
    ("empty", [], "--datapath: class folder"),
    ("loose", [], "x.tif outside a class folder; volumes to classify sit in the folder of their class"),
    ("twice", [], "--datapath: benign/a.tif and tumour/a.nii share the name 'a'; a split and patients.csv name"),
    ("", ["--task", "segmentation"], "--model: resnet3d is a classifier (one class per image); --task "
                                     "segmentation trains a dense model: use --model unet3d"),
    ("", ["--model", "unet3d"], "--task: --model unet3d predicts a class per pixel; add --task segmentation"),
    ("file", [], "--datapath: volumes are classified from a folder of class folders"),
    ("", ["--model", "resnet"], "--image-size: 16,16,16 is a volume's patch but --model resnet takes images"),
    ("", ["--app", "cifar"], "--app: CIFAR-10 holds images, not volumes"),
    ("", ["--classes", "benign,tumour,normal"], "--classes: normal: no such class folder"),
    ("", ["--augment", "flip"], "--augment: does not apply to volumes yet"),
    ("", ["--split-size", "1", "--spatial-size", "1"], "--spatial-size: --model resnet3d gives one class per volume, "
                                                       "and its head joined on volume tiles is not checked"),
])
def test_volume_classification_flags_and_folders_that_do_not_fit_are_refused(tmp_path, capsys, change, flags, words):
    data = write_volume_classes(tmp_path / "v", shape=SHAPE)
    if change == "empty":
        (data / "normal").mkdir()
    if change == "twice":
        nibabel.save(nibabel.Nifti1Image(np.zeros(SHAPE, np.uint16), np.eye(4)), data / "tumour" / "a.nii")
    if change == "loose":
        tifffile.imwrite(data / "x.tif", np.zeros(SHAPE, np.uint16), imagej=True)
    datapath = data / "benign" / "a.tif" if change == "file" else data
    code, out, err = run_train([*RESNET3D, "--datapath", str(datapath), *flags], capsys)
    assert code == 2 and out == "" and words in err, err
    if change == "empty":
        assert "normal holds no images this run reads" in err


def test_a_folder_of_images_and_masks_is_refused_for_classification(tmp_path, capsys):
    data = write_volume_pairs(tmp_path / "v", shape=SHAPE)
    code, out, err = run_train([*RESNET3D, "--datapath", str(data)], capsys)
    assert code == 2 and "--datapath: " in err and "holds images/ with their masks/ (per-pixel labels)" in err, err
