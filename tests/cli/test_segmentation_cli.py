"""``train --task segmentation``: 4 tiles equal one process (float64), per-class Dice in the summary, a checkpoint
that says what it is, ``evaluate`` of it; every bad input refused before the first step with one message naming
the file (and the feature); a checkpoint of one task refused by the other."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from mpi4dl_nb.cli import train_cmd as cli
from mpi4dl_nb.errors import ConfigError
from tests.support.bad_data import write_tiles
from tests.support.battery import shared_job
from tests.support.pyramid import write_pyramid
from tests.support.segmentation_data import write_pairs
from tests.support.train_in_process import run_train

UNET = ["--task", "segmentation", "--model", "unet", "--num-layers", "2", "--num-filters", "4"]
ONE_PROCESS = ["--split-size", "1", "--spatial-size", "0"]
JOB = shared_job(4, "segmentation_cli", timeout=600)   # 17 s alone, 240-290 s in the two-stream suite here


@pytest.mark.parametrize("check", ["losses equal one process", "evaluation equals one process", "evaluate on tiles",
                                   "checkpoint record"])
def test_train_on_four_tiles_equals_one_process(shared_launch, check):
    """``train --task segmentation`` set up as the command does, every stage spatial on 4 ranks (float64): the
    losses and weights, the held-out Dice/IoU counts and loss, ``evaluate`` of its checkpoint on the tiles,
    the checkpoint's record (tests/mpi/segmentation_cli.py)."""
    shared_launch(JOB).require([check])


# ------------------------------------------------------------------------- bad input, one process
def test_bad_pairs_are_refused_before_the_first_step_naming_the_file(tmp_path, capsys):
    data = write_pairs(tmp_path / "pairs", count=4, size=32)
    Image.fromarray(np.zeros((32, 30), np.uint8)).save(data / "masks" / "tile1.png")
    Image.fromarray(np.full((32, 32), 5, np.uint8)).save(data / "masks" / "tile2.png")
    code, out, err = run_train([*UNET, "--datapath", str(data), "--num-classes", "3", "--image-size", "32",
                               "--batch-size", "2", "--steps", "1", "--no-progress", *ONE_PROCESS], capsys)
    assert code == 2 and out == "" and "2 of 4 files" in err
    assert "tile1.png: mask masks/tile1.png is 30x32 pixels but its image is 32x32" in err
    assert "tile2.png: mask masks/tile2.png holds label(s) 5 outside 0..2" in err


def feature(coordinates, name, ident):
    return {"type": "Feature", "id": ident, "geometry": {"type": "Polygon", "coordinates": coordinates},
            "properties": {"objectType": "annotation", "classification": {"name": name, "color": [200, 0, 0]}}}


GOOD = [feature([[[10, 10], [100, 20], [90, 110], [15, 100], [10, 10]]], "tumor", "t1")]


@pytest.mark.parametrize("extra, fragment", [
    (None, "s1.geojson: not valid JSON (line 1"),
    (feature([[[5, 5], [20, 5], [12, 20], [5, 5]]], "necrosis", "n1"),
     "feature 1 ('n1'): class 'necrosis' is not among --classes background,tumor,stroma"),
    (feature([[[0, 0], [40, 40], [40, 0], [0, 40], [0, 0]]], "stroma", "b1"), "feature 1 ('b1'): its outer ring "
     "crosses itself near (20.0, 20.0)"),
    (feature([[[100, 100], [200, 100], [150, 150], [100, 100]]], "stroma", "o1"),
     "feature 1 ('o1'): vertex (200, 100) lies outside the slide (0..128 x 0..128"),
])
def test_bad_annotations_are_refused_naming_the_file_and_the_feature(tmp_path, capsys, extra, fragment):
    folder = tmp_path / "slides"
    folder.mkdir()
    write_pyramid(folder / "s1.tif", np.random.default_rng(0).integers(60, 200, (128, 128, 3), dtype=np.uint8),
                  levels=2, tile=64)
    text = "{not json" if extra is None else json.dumps({"type": "FeatureCollection", "features": [*GOOD, extra]})
    (folder / "s1.geojson").write_text(text)
    code, out, err = run_train([*UNET, "--datapath", str(folder), "--classes", "background,tumor,stroma",
                               "--image-size", "32", "--batch-size", "2", "--steps", "1", "--min-tissue", "0",
                               "--no-progress", *ONE_PROCESS], capsys)
    assert code == 2 and out == "" and "s1.tif" in err and fragment in err


@pytest.mark.parametrize("argv, flag, fragment", [
    (["--model", "unet"], "--task", "add --task segmentation"),
    (["--task", "segmentation"], "--model", "resnet is a classifier"),
    (["--task", "segmentation", "--model", "unet"], "--task", "segmentation needs per-pixel labels"),
    (["--task", "segmentation", "--model", "unet", "--app", "cifar"], "--app", "CIFAR-10 has no per-pixel labels"),
    (["--loss", "dice"], "--loss", "applies to --task segmentation only"),
    (["--ignore-index", "255"], "--ignore-index", "applies to --task segmentation only"),
    ([*UNET, "--app", "medical", "--ignore-index", "1"], "--ignore-index", "1 is class 'DAB' of the 2 classes"),
    ([*UNET, "--app", "medical", "--keep-best", "val_roc_auc", "--val-fraction", "0.5", "--checkpoint-dir", "x"],
     "--keep-best", "val_roc_auc is not a figure of --task segmentation"),
    ([*UNET, "--app", "medical", "--class-weights", "1,2,3"], "--class-weights", "3 weights for 2 classes"),
])
def test_bad_segmentation_flags_are_refused(argv, flag, fragment):
    args = cli.train_parser().parse_args(argv)
    with pytest.raises(ConfigError) as err:
        cli.train_plan(args)
    assert err.value.knob == flag and fragment in str(err.value)


def test_a_mask_folder_or_annotated_slides_need_their_class_flags(tmp_path):
    data = write_pairs(tmp_path / "pairs", count=1, size=16)
    slides = tmp_path / "slides"
    slides.mkdir()
    write_pyramid(slides / "s1.tif", np.full((128, 128, 3), 200, dtype=np.uint8), levels=2)
    for argv, flag, fragment in (([*UNET, "--datapath", str(data)], "--num-classes", "masks hold class indices"),
                                 ([*UNET, "--datapath", str(slides)], "--classes", "annotated slides"),
                                 (["--datapath", str(data), "--app", "medical"], "--datapath", "--task segmentation")):
        with pytest.raises(ConfigError) as err:
            cli.train_plan(cli.train_parser().parse_args(argv))
        assert err.value.knob == flag and fragment in str(err.value)


def test_class_folders_for_segmentation_say_they_hold_one_label_per_image(tmp_path):
    write_tiles(tmp_path, per_class=2, classes=("a", "b"))
    with pytest.raises(ConfigError) as err:
        cli.train_plan(cli.train_parser().parse_args([*UNET, "--datapath", str(tmp_path)]))
    assert err.value.knob == "--task" and "drop --task segmentation" in str(err.value)
    assert "--classes" not in str(err.value)


def test_a_suggested_keep_best_metric_is_accepted():
    argv = [*UNET, "--app", "medical", "--val-fraction", "0.5", "--checkpoint-dir", "x"]
    with pytest.raises(ConfigError) as err:
        cli.train_plan(cli.train_parser().parse_args([*argv, "--keep-best", "val_roc_auc"]))
    suggested = str(err.value).split("use one of ")[1].split(", ")
    assert suggested and "val_balanced_accuracy" not in suggested
    for metric in suggested:
        cli.train_plan(cli.train_parser().parse_args([*argv, "--keep-best", metric]))


def test_a_checkpoint_of_one_task_is_refused_by_the_other(tmp_path, capsys):
    small = ["--image-size", "16", "--batch-size", "2", "--steps", "1", "--no-progress", *ONE_PROCESS]
    data = write_pairs(tmp_path / "pairs", count=2, size=16)
    segmentation = [*UNET, "--datapath", str(data), "--num-classes", "3", *small]
    classifier = ["--model", "resnet", "--num-layers", "11", "--num-filters", "2", "--num-samples", "2", *small]
    assert run_train([*segmentation, "--checkpoint-dir", str(tmp_path / "seg")], capsys)[0] == 0
    assert run_train([*classifier, "--checkpoint-dir", str(tmp_path / "cls")], capsys)[0] == 0
    code, _, err = run_train([*classifier, "--steps", "2", "--resume", str(tmp_path / "seg")], capsys)
    assert code == 2 and "is a segmentation checkpoint, not classification: use --task segmentation" in err
    code, _, err = run_train([*segmentation, "--steps", "2", "--resume", str(tmp_path / "cls")], capsys)
    assert code == 2 and "is a classification checkpoint, not segmentation: use --task classification" in err


def test_evaluate_refuses_a_checkpoint_of_the_other_task():
    from types import SimpleNamespace

    from mpi4dl_nb.checkpoint.record import DataRecord, RunRecord
    from mpi4dl_nb.data.apps import AppKind
    from mpi4dl_nb.data.task import Task
    from mpi4dl_nb.models.spec import ModelSpec
    from mpi4dl_nb.run.evaluate_job import EvaluateJob, EvaluatePlan
    from mpi4dl_nb.run.evaluate_run import Evaluation

    def evaluation(**keywords: object) -> Evaluation:
        return Evaluation(EvaluatePlan(EvaluateJob.of(checkpoint="x", **keywords), "x"), SimpleNamespace(rank=0))

    data = DataRecord(AppKind.MEDICAL, 32, 2)
    segmentation = RunRecord(ModelSpec.of("unet", num_classes=3), data, task=Task.SEGMENTATION)
    classifier = RunRecord(ModelSpec.of("resnet", num_classes=3), data)
    for record, wanted, theirs in ((segmentation, "classification", "segmentation"),
                                   (classifier, "segmentation", "classification")):
        with pytest.raises(ConfigError, match=f"is a {theirs} checkpoint, not {wanted}: use --task {theirs}"):
            evaluation(task=wanted).check_record(record, "--checkpoint x")
        evaluation().check_record(record, "x")
