"""Nothing lost, nothing silent: the train command's refusals, resume checks, divergence, disk full (one process)."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mpi4dl_nb.checkpoint import files as ck
from mpi4dl_nb.cli import train_cmd as cli
from tests.support.bad_data import flip_bytes, truncate, write_tiles
from tests.support.pyramid import write_pyramid
from tests.support.summary import json_record

MODEL = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4",
         "--image-size", "32", "--batch-size", "4", "--num-samples", "16", "--no-progress",
         "--split-size", "1", "--spatial-size", "0"]


def train(capsys, argv: list[str]) -> tuple[int, str, str]:
    """``python -m mpi4dl_nb train`` in this process (one rank): exit code, stdout, stderr."""
    try:
        code = cli.main(MODEL + argv)
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def table(row: str, seconds: float, code: int) -> None:
    print(f"\n[batch-jobs table] {row}: exit {code} after {seconds:.1f} s")


@pytest.mark.parametrize("argv,flag", [
    (["--lr", "-5"], "--lr"), (["--lr", "nan"], "--lr"), (["--num-filters", "0"], "--num-filters"),
    (["--num-layers", "0"], "--num-layers"), (["--momentum", "2"], "--momentum"),
    (["--seed", "-1"], "--seed"), (["--step-timeout", "-3"], "--step-timeout"),
    (["--min-tissue", "1.5"], "--min-tissue"),
    (["--allow-config-change", "colour"], "--allow-config-change"),
    (["--datapath", "/data"], "--datapath"),            # --app synthetic does not read it
])
def test_flags_refused_at_parse_time(capsys, argv, flag):
    """Item 5 (and 4): one configuration error naming the flag, exit 2, before any set-up."""
    start = time.monotonic()
    code, _, err = train(capsys, argv)
    assert code == 2 and f"configuration error: {flag}" in err, err
    assert "Traceback" not in err and time.monotonic() - start < 5


def test_one_class_data_is_refused_unless_asked(capsys, tmp_path):
    """Item 4: a flat folder (every label 0) is refused; --num-classes 1 trains on it."""
    write_tiles(tmp_path / "flat", per_class=4, classes=())
    code, _, err = train(capsys, ["--app", "medical", "--datapath", str(tmp_path / "flat"), "--steps", "1"])
    assert code == 2 and "one class only" in err and "--num-classes 1" in err
    code, out, _ = train(capsys, ["--app", "medical", "--datapath", str(tmp_path / "flat"), "--steps", "1",
                                  "--num-classes", "1"])
    assert code == 0 and json_record(out)["steps_run"] == 1


def bad_folder(root: Path) -> dict[str, Path]:
    """Two classes of good tiles, plus a corrupt, a truncated, a too small and a 16-bit one."""
    from PIL import Image

    paths = write_tiles(root, per_class=5)
    bad = {"corrupt": flip_bytes(paths[1]), "truncated": truncate(paths[6], 0.6)}
    bad["small"] = root / "a" / "small.png"
    Image.fromarray(np.zeros((20, 20, 3), np.uint8)).save(bad["small"])
    bad["16-bit"] = root / "b" / "deep.png"
    Image.fromarray(np.full((40, 40), 300, np.uint16)).save(bad["16-bit"])
    return bad


def test_bad_files_refused_up_front_or_skipped(capsys, tmp_path):
    """Item 5: bad tiles are listed in one message before training (exit 2); --skip-bad-files trains on the rest."""
    bad = bad_folder(tmp_path / "tiles")
    argv = ["--app", "medical", "--datapath", str(tmp_path / "tiles"), "--num-classes", "2", "--steps", "2"]
    code, out, err = train(capsys, argv)
    assert code == 2 and not out and "4 of 12 files" in err and "--skip-bad-files" in err, err
    for what, path in bad.items():
        assert str(path) in err, what
    assert "smaller than --image-size 32" in err and "I;16" in err and "truncated" in err.lower()
    code, out, err = train(capsys, argv + ["--skip-bad-files"])
    assert code == 0 and "skipping 4 of 12 files" in err and json_record(out)["steps_run"] == 2


def test_truncated_slide_in_a_folder_is_a_bad_slide(capsys, tmp_path):
    """Item 5: a cut-off pyramidal TIFF is reported as such, not taken for a one-image tile folder."""
    from mpi4dl_nb.data import ihc_image

    image = np.full((512, 512, 3), 255, np.uint8)
    image[:384, :384] = ihc_image()[:384, :384]
    for name in ("a", "b"):
        (tmp_path / "slides" / name).mkdir(parents=True)
        write_pyramid(tmp_path / "slides" / name / "s.tif", image)
    truncate(tmp_path / "slides" / "b" / "s.tif", 0.9)
    code, _, err = train(capsys, ["--app", "medical", "--datapath", str(tmp_path / "slides"), "--steps", "1",
                                  "--num-classes", "2"])
    assert code == 2 and "1 of 2 files" in err and "b/s.tif: truncated TIFF" in err, err
    assert "fewer than one batch" not in err


@pytest.mark.parametrize("app", ["medical", "cifar"])
def test_missing_validation_path_refused_before_the_first_step(capsys, tmp_path, monkeypatch, app):
    """--val-datapath that does not exist: one line naming that flag and the path, exit 2, no step taken."""
    from mpi4dl_nb.run.trainer import Trainer

    def never(self):
        raise AssertionError("a training step ran")
    monkeypatch.setattr(Trainer, "run", never)
    write_tiles(tmp_path / "tiles", per_class=4)     # refused before the training data is opened
    missing = str(tmp_path / "no-such-val")
    classes = "2" if app == "medical" else "10"      # CIFAR-10 has ten (another count is refused first)
    code, out, err = train(capsys, ["--app", app, "--datapath", str(tmp_path / "tiles"), "--num-classes", classes,
                                    "--steps", "1", "--val-datapath", missing])
    assert code == 2 and not out, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"error: --val-datapath {missing!r} does not exist" in lines[0], err


def test_bad_validation_files_refused_up_front_or_skipped(capsys, tmp_path):
    """Bad files under --val-datapath are listed before training (naming the flag); --skip-bad-files leaves them out."""
    write_tiles(tmp_path / "tiles", per_class=4)
    held = write_tiles(tmp_path / "val", per_class=3)
    truncate(held[4], 0.6)
    argv = ["--app", "medical", "--datapath", str(tmp_path / "tiles"), "--num-classes", "2", "--steps", "1",
            "--val-datapath", str(tmp_path / "val")]
    code, out, err = train(capsys, argv)
    assert code == 2 and not out, err
    assert f"1 of 6 files in --val-datapath {str(tmp_path / 'val')!r} cannot be validated on" in err, err
    assert str(held[4]) in err and "--skip-bad-files to validate on the other 5" in err
    code, out, err = train(capsys, argv + ["--skip-bad-files"])
    assert code == 0 and "skipping 1 of 6 files in --val-datapath" in err, err
    record = json_record(out)
    assert record["steps_run"] == 1 and record["val_count"] == 5


def test_held_out_data_names_the_validation_flag(tmp_path):
    """``evaluate`` shares held_out_data: a missing --val-datapath is named as such there too."""
    from mpi4dl_nb.data.apps import AppKind
    from mpi4dl_nb.run.held_out_spec import HeldOutSpec
    from mpi4dl_nb.run.job import DataSpec
    from mpi4dl_nb.run.job_data import held_out_data

    data = DataSpec(app=AppKind.MEDICAL, num_classes=2, num_samples=8)
    with pytest.raises(FileNotFoundError, match="--val-datapath '.*gone' does not exist"):
        held_out_data(data, HeldOutSpec(val_datapath=str(tmp_path / "gone")), 0, dataset=None)  # type: ignore[arg-type]


def test_resume_refuses_a_changed_configuration(capsys, tmp_path):
    """Item 4: another image size, batch size, seed, app or data does not resume unless allowed."""
    folder = str(tmp_path / "ck")
    assert train(capsys, ["--steps", "2", "--checkpoint-dir", folder])[0] == 0
    for argv, field in ((["--image-size", "64"], "image_size 32 -> 64"),
                        (["--batch-size", "8"], "batch_size 4 -> 8"),
                        (["--seed", "1"], "seed 0 -> 1"),
                        (["--app", "medical", "--num-classes", "10"], "app 'synthetic' -> 'medical'"),
                        (["--num-samples", "32"], "data ")):
        code, _, err = train(capsys, argv + ["--steps", "3", "--checkpoint-dir", folder,
                                             "--resume", "latest"])
        assert code == 2 and field in err and "--allow-config-change" in err, (argv, err)
    code, out, err = train(capsys, ["--seed", "1", "--steps", "3", "--checkpoint-dir", folder,
                                    "--resume", "latest", "--allow-config-change", "seed"])
    assert code == 0 and "resuming with seed 0 -> 1" in err
    record = json_record(out)
    assert record["start_step"] == 2 and record["steps"] == 3


def test_latest_skips_a_truncated_checkpoint(capsys, tmp_path):
    """Item 8: the truncated newest checkpoint is named and skipped for the intact older one."""
    folder = tmp_path / "ck"
    assert train(capsys, ["--steps", "2", "--checkpoint-every", "1", "--checkpoint-dir", str(folder)])[0] == 0
    newest = ck.latest_checkpoint(folder)
    truncate(newest, 0.5)
    code, out, err = train(capsys, ["--steps", "2", "--checkpoint-dir", str(folder), "--resume", "latest"])
    assert code == 0 and f"skipped newer {newest.name}" in err and "truncated" in err, err
    assert json_record(out)["start_step"] == 1
    # a fresh step-2 checkpoint (another run id) was written beside the damaged one, which stays
    assert newest.exists() and len([e for e in ck.list_checkpoints(folder) if e.step == 2]) == 2


def test_steps_reached_with_verbose_is_no_error(capsys, tmp_path):
    """Item 8: --steps equal to the checkpoint's step with -v says there is nothing to train (no TypeError)."""
    folder = str(tmp_path / "ck")
    assert train(capsys, ["--steps", "2", "--checkpoint-dir", folder])[0] == 0
    code, out, err = train(capsys, ["--steps", "2", "--checkpoint-dir", folder, "--resume", "latest", "-v"])
    assert code == 0 and "nothing to train" in err and "final loss n/a" in err, err
    assert json_record(out)["steps_run"] == 0


def test_checkpoint_dir_is_refused_before_training(capsys, tmp_path):
    """Item 2: a checkpoint dir under a file stops the run before the first step, with the reason."""
    (tmp_path / "afile").write_text("x")
    start = time.monotonic()
    code, out, err = train(capsys, ["--steps", "50", "--checkpoint-dir", str(tmp_path / "afile" / "ck")])
    assert code == 2 and not out and "--checkpoint-dir" in err and "is a file" in err
    assert "step 1" not in err and "Traceback" not in err
    table("checkpoint dir not creatable", time.monotonic() - start, code)


def test_divergence_stops_and_keeps_the_last_good_checkpoint(capsys, tmp_path):
    """Item 3: --lr 1e6 stops at the first non-finite step (exit 3, naming it and what went non-finite:
    here BatchNorm's running variance overflows float32 a step before the loss); every checkpoint on
    disk is finite."""
    folder = tmp_path / "ck"
    start = time.monotonic()
    code, out, err = train(capsys, ["--lr", "1e6", "--steps", "30", "--checkpoint-every", "1",
                                    "--keep-checkpoints", "30", "--checkpoint-dir", str(folder)])
    assert code == 3 and not out and "stopped: step " in err and "non-finite" in err, err
    assert "running_var" in err or "loss" in err
    step = int(err.split("stopped: step ")[1].split()[0])
    saved = [e for e in ck.list_checkpoints(folder) if e.problem is None]
    assert [e.step for e in saved] == list(range(1, step)) and str(saved[-1].path) in err
    for entry in saved:
        state = ck.load_checkpoint(entry.path)
        assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    table("non-finite loss (--lr 1e6, one process)", time.monotonic() - start, code)


def test_skip_step_leaves_weights_unchanged_then_stops(capsys, tmp_path):
    """--on-nonfinite skip-step: a skipped step changes no weight, BN statistic or momentum; 5 in a row stop the run."""
    folder = tmp_path / "ck"
    code, _, err = train(capsys, ["--lr", "1e6", "--steps", "30", "--checkpoint-every", "1",
                                  "--keep-checkpoints", "30", "--checkpoint-dir", str(folder),
                                  "--on-nonfinite", "skip-step"])
    assert code == 3 and "steps in a row" in err and err.count("step skipped") == 4, err
    states = {e.step: ck.load_checkpoint(e.path) for e in ck.list_checkpoints(folder)}
    skipped = sorted(int(line.split("step ")[1].split()[0]) for line in err.splitlines()
                     if "step skipped" in line)
    before = states[skipped[0] - 1]
    for step in skipped:
        for part in ("model", "optimizer"):
            assert json.dumps({k: str(v) for k, v in states[step][part].items()}) == \
                json.dumps({k: str(v) for k, v in before[part].items()}), (step, part)


def test_disk_full_mid_run_stops_and_keeps_older_checkpoints(capsys, tmp_path):
    """A disk that fills up: the failed save stops the run (exit 5) and the older checkpoint stays intact."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=120k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        start = time.monotonic()
        code, out, err = train(capsys, ["--steps", "6", "--checkpoint-every", "1", "--keep-checkpoints", "3",
                                        "--checkpoint-dir", str(disk)])
        assert code == 5 and not out and "No space left on device" in err and "intact" in err, err
        (entry,) = ck.list_checkpoints(disk)
        assert entry.step == 1 and ck.load_checkpoint(entry.path)["step"] == 1
        assert not [p for p in disk.iterdir() if ".tmp-" in p.name]
        table("disk full while saving", time.monotonic() - start, code)
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
