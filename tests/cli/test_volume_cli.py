"""``train --model unet3d`` on a folder of volumes: 1x2x2 tiles equal one process (float64), each rank reading only its
tile; bad label volumes and 2-D images refused before the first step naming the file; the volume flags checked."""
from __future__ import annotations

import numpy as np
import pytest

from mpi4dl_nb.checkpoint.record import read_checkpoint
from mpi4dl_nb.cli import evaluate_cmd, layout_cmd
from mpi4dl_nb.evaluation.pixel_metrics import sample_dice
from mpi4dl_nb.run.data_choice import parse_image_size, parse_voxel_size
from tests.support.battery import shared_job
from tests.support.requirements import VOLUMES_EXTRA, required_module
from tests.support.summary import json_record
from tests.support.train_in_process import run_command, run_train
from tests.support.volume_data import write_volume_pairs

nibabel = required_module("nibabel", "volume CLI tests", VOLUMES_EXTRA)
tifffile = required_module("tifffile", "volume CLI tests", VOLUMES_EXTRA)

JOB = shared_job(4, "volume_cli", timeout=300)
UNET3D = ["--task", "segmentation", "--model", "unet3d", "--num-filters", "2", "--num-classes", "3",
          "--image-size", "8,8,8", "--batch-size", "1", "--steps", "1", "--no-progress", "--split-size", "1",
          "--spatial-size", "0"]


@pytest.mark.parametrize("check", ["volume losses equal one process", "held-out volumes equal one process",
                                   "resume equals three straight steps", "each rank reads its tile"])
def test_train_on_volume_tiles_equals_one_process(shared_launch, check):
    """``train --task segmentation --model unet3d --slice-method 1x2x2 --val-fraction`` on TIFF stacks and a NIfTI,
    every stage spatial on 4 ranks (float64): losses and weights equal one process, so do the held-out volume's
    loss, confusion matrix and Dice; 2 steps resumed to 3 equal 3 steps in one process; the ranks read their tiles
    only (tests/mpi/volume_cli.py)."""
    shared_launch(JOB).require([check])


def test_bad_label_volumes_and_flat_images_are_refused_naming_the_file(tmp_path, capsys):
    data = write_volume_pairs(tmp_path / "v", shape=(10, 12, 14), names=("a", "b", "c", "d"))
    tifffile.imwrite(data / "masks" / "a.tif", np.zeros((10, 12, 13), np.uint8), photometric="minisblack")
    labels = np.zeros((14, 12, 10), np.uint8)
    labels[1, 2, 3] = 9
    nibabel.save(nibabel.Nifti1Image(labels, np.eye(4)), data / "masks" / "b.nii.gz")
    (data / "images" / "c.tif").unlink()
    tifffile.imwrite(data / "images" / "c.tif", np.zeros((12, 14), np.uint16))              # one page: 2-D
    code, out, err = run_train([*UNET3D, "--datapath", str(data)], capsys)
    assert code == 2 and out == "" and "3 of 4 files" in err, err
    assert "a.tif: label volume masks/a.tif is 10x12x13 voxels (DxHxW) but its image is 10x12x14" in err
    assert "b.nii.gz: label volume masks/b.nii.gz holds label(s) 9 outside 0..2 (--num-classes 3" in err
    assert "c.tif: a 2-D image (one page, shape (12, 14)), not a volume" in err


def test_a_finer_voxel_size_than_the_files_is_refused_naming_each(tmp_path, capsys):
    data = write_volume_pairs(tmp_path / "v", shape=(8, 8, 8))      # 1 x 0.5 x 0.5 µm voxels
    code, out, err = run_train([*UNET3D, "--datapath", str(data), "--voxel-size", "0.5"], capsys)
    assert code == 2 and "2 of 2 files" in err, err
    assert "a.tif: --voxel-size:" in err and "has 1 µm voxels along z; 0.5 µm would invent detail" in err


@pytest.mark.parametrize("flags, words", [
    (["--image-size", "8"], "--image-size: --model unet3d trains on volumes: give --image-size D,H,W"),
    (["--model", "unet"], "--image-size: 8,8,8 is a volume's patch but --model unet takes images"),
    (["--mpp", "0.5"], "--mpp: sets images' µm per pixel; volumes take --voxel-size Z,Y,X"),
    (["--val-datapath", "x"], "--val-datapath: does not apply to volumes yet"),
    (["--val-fraction", "0.5", "--group-by", "(.+)"], "--group-by: groups tile files by name; a split of volumes"),
])
def test_volume_flags_that_do_not_fit_are_refused(tmp_path, capsys, flags, words):
    data = write_volume_pairs(tmp_path / "v", shape=(8, 8, 8))
    code, out, err = run_train([*UNET3D, "--datapath", str(data), *flags], capsys)
    assert code == 2 and words in err, err


def test_image_and_voxel_size_flags_parse():
    assert parse_image_size("32") == 32 and parse_image_size("8, 16,24") == (8, 16, 24)
    assert parse_voxel_size("2") == (2.0, 2.0, 2.0) and parse_voxel_size("2,0.5,0.5") == (2.0, 0.5, 0.5)
    for bad in ("8,16", "8,0,8", "a"):
        with pytest.raises(ValueError, match="D,H,W"):
            parse_image_size(bad)
    for bad in ("1,2", "0", "x"):
        with pytest.raises(ValueError, match="Z,Y,X"):
            parse_voxel_size(bad)


RESUMABLE = [*UNET3D[:UNET3D.index("--image-size")], "--image-size", "4,8,8", "--batch-size", "1", "--no-progress",
             "--split-size", "1", "--spatial-size", "0", "--dtype", "float64", "--lr", "0.05", "--momentum", "0.9"]


def test_a_volume_checkpoint_knows_its_patch_and_a_resume_with_another_is_refused(tmp_path, capsys):
    """The checkpoint records the patch's D,H,W, voxel size and tile grid (not only its largest side, as before);
    another --image-size D,H,W, even one of the same largest side (which was silently continued), is refused naming
    the checkpoint's patch and this run's; ``evaluate`` refuses the volume checkpoint. (Resuming exactly:
    tests/mpi/volume_cli.py, on tiles.)"""
    data = write_volume_pairs(tmp_path / "v", shape=(8, 10, 12))
    flags = [*RESUMABLE, "--datapath", str(data), "--checkpoint-dir", str(tmp_path / "ck"), "--voxel-size", "1,0.5,0.5"]
    code, out, err = run_train([*flags, "--steps", "1"], capsys)
    assert code == 0, err
    summary = json_record(out)
    assert summary["volume_size"] == [4, 8, 8] and summary["image_size"] == 8
    record = read_checkpoint(summary["checkpoint"]).record
    assert (record.data.volume_size, record.data.voxel_size, record.data.volume_grid) == ((4, 8, 8), (1, .5, .5), None)
    assert record.identity["image_size"] == "4,8,8"
    size = "8,8,4"
    changed = [*flags[:flags.index("4,8,8")], size, *flags[flags.index("4,8,8") + 1:]]
    code, out, err = run_train([*changed, "--steps", "2", "--resume", "latest"], capsys)
    assert code == 2 and out == "", out
    assert f"image_size '4,8,8' -> '{size}' (--image-size)" in err and "--allow-config-change image_size" in err, err
    # evaluate takes image models: a volume checkpoint is refused before any work, naming it (was a BatchNorm traceback)
    code, _, err = run_command(evaluate_cmd.main, ["--checkpoint", summary["checkpoint"], "--split-size", "1",
                                                    "--spatial-size", "0"], capsys)
    assert code == 2
    assert "holds a model of volumes (unet3d)" in err and "Traceback" not in err, err


def test_val_fraction_holds_out_whole_patients_and_scores_each_volume(tmp_path, capsys):
    """``--val-fraction`` on a folder with a patients.csv holds out a whole patient (both its volumes, or the other
    patient's one); every evaluation prints the mean Dice per volume and the summary lists each held-out volume's."""
    data = write_volume_pairs(tmp_path / "v", shape=(4, 8, 8), classes=2, names=("a", "b", "c"))
    (data / "patients.csv").write_text("# volume -> patient\npatient;volume\np1;a.tif\np1;b\n\np2;c.tif\n")
    flags = [*RESUMABLE, "--num-classes", "2", "--datapath", str(data), "--val-fraction", "0.5", "--steps", "2",
             "--checkpoint-dir", str(tmp_path / "ck")]
    code, out, err = run_train(flags, capsys)
    assert code == 0, err
    summary = json_record(out)
    split = read_checkpoint(summary["checkpoint"]).record.split
    assert split is not None and split.grouping == "patient" and {split.train, split.val} == {("p1",), ("p2",)}
    held = 2 if split.val == ("p1",) else 1
    assert "held-out split of whole volumes, grouped by patient (patients.csv)" in err, err
    assert f"  val: {held} volume(s) of 1 patient(s): {'a, b' if held == 2 else 'c'}" in err, err
    evaluations = [line for line in err.splitlines() if line.startswith("eval at step")]
    assert len(evaluations) == 2 // (3 - held) + (2 % (3 - held) != 0) and all(
        "val_mean_volume_dice" in line for line in evaluations), err
    assert summary["val_count"] == held and len(summary["val_volume_dice"]) == held
    assert summary["val_mean_volume_dice"] == pytest.approx(np.mean(summary["val_volume_dice"]), abs=1e-15)
    assert summary["val_pixels"] == held * 4 * 8 * 8


def test_a_fold_of_volumes_holds_out_whole_patients(tmp_path, capsys):
    """``--folds 2 --fold I``: the same grouping dealt into folds; fold 0 and fold 1 hold out the two patients."""
    data = write_volume_pairs(tmp_path / "v", shape=(4, 8, 8), classes=2, names=("a", "b", "c"))
    (data / "patients.csv").write_text("volume,patient\na,p1\nb,p1\nc,p2\n")
    held = []
    for fold in (0, 1):
        flags = [*RESUMABLE, "--num-classes", "2", "--datapath", str(data), "--folds", "2", "--fold", str(fold),
                 "--steps", "1", "--checkpoint-dir", str(tmp_path / f"ck{fold}")]
        code, out, err = run_train(flags, capsys)
        assert code == 0, err
        summary = json_record(out)
        split = read_checkpoint(summary["checkpoint"]).record.split
        assert split is not None and split.grouping == "patient" and (split.folds, split.fold) == (2, fold)
        assert summary["val_count"] == (2 if split.val == ("p1",) else 1) and "val_mean_volume_dice" in summary
        held.append(split.val)
    assert sorted(held) == [("p1",), ("p2",)]


def test_a_patients_file_missing_a_volume_is_refused_naming_it(tmp_path, capsys):
    data = write_volume_pairs(tmp_path / "v", shape=(4, 8, 8), names=("a", "b", "c"))
    (data / "patients.csv").write_text("volume,patient\na.tif,p1\nb.nii.gz,p2\n")
    code, _, err = run_train([*RESUMABLE, "--datapath", str(data), "--val-fraction", "0.5", "--steps", "1"], capsys)
    assert code == 2 and "patients.csv lists no patient for 1 of 3 volumes (c.tif)" in err, err


def test_a_volume_dice_averages_the_classes_its_labels_hold():
    """Class 2 is neither labelled nor predicted, class 1 predicted but not labelled: both left out; the voxels
    predicted 1 are misses of class 0 (m[true][predicted])."""
    matrix = np.array([[6, 2, 0], [0, 0, 0], [0, 0, 0]])
    assert sample_dice(matrix) == pytest.approx(2 * 6 / (8 + 6))
    matrix = np.array([[3, 1, 0], [0, 0, 0], [2, 0, 4]])
    assert sample_dice(matrix) == pytest.approx((2 * 3 / (4 + 5) + 2 * 4 / (6 + 4)) / 2)
    assert sample_dice(np.zeros((3, 3), np.int64)) is None


def run_layout(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``layout argv`` in this process (not launched): (exit code, stdout, stderr)."""
    try:
        code = layout_cmd.main(argv)
    except SystemExit as stop:
        code = int(stop.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_layout_shows_a_volume_patch_s_tiles_and_refuses_what_does_not_fit(monkeypatch, capsys):
    """``layout --image-size D,H,W`` (was: N only) lists each tile's voxels of the patch on the DxRxC grid (uneven
    along the odd side), and refuses a patch too thin for the grid, an image grid, and a stage cut (--model)."""
    monkeypatch.setattr(layout_cmd, "launched_world", lambda: (0, 1, False))
    grid = ["--split-size", "1", "--spatial-size", "1", "--num-spatial-parts", "8", "--slice-method", "2x2x2"]
    code, out, err = run_layout([*grid, "--image-size", "8,16,21"], capsys)
    assert code == 0, err
    assert "tiles of the 8x16x21 (DxHxW) volume patch" in out and "(1,1,1)" in out
    assert "  tile 0: [0, 4) x [0, 8) x [0, 11)\n" in out and "  tile 7: [4, 8) x [8, 16) x [11, 21)" in out
    code, _, err = run_layout([*grid, "--image-size", "1,16,16"], capsys)
    assert code == 2 and "2 tiles along depth of a 1x16x16 volume are 0 voxels" in err, err
    square = [*grid[:-2], "--num-spatial-parts", "4"]
    code, _, err = run_layout([*square, "--image-size", "8,16,16"], capsys)
    assert code == 2 and "--slice-method: square tiles images; a volume's patch 8x16x16" in err, err
    code, _, err = run_layout([*grid, "--image-size", "8,16,16", "--model", "unet3d"], capsys)
    assert code == 2 and "--image-size: 8,16,16 is a volume's patch; the stage cut (--model) is computed" in err
