"""Cohorts and leak-free splits from the command line (one process: what is checked is who lands on which side,
not exactness across ranks): tile folders grouped by slide, cohort manifests grouped by patient."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mpi4dl_nb.checkpoint.files import list_checkpoints
from mpi4dl_nb.checkpoint.record import RunRecord, read_checkpoint
from mpi4dl_nb.cli import train_cmd as cli

ONE_PROCESS = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4",
               "--image-size", "32", "--split-size", "1", "--spatial-size", "0", "--batch-size", "2",
               "--steps", "1", "--no-progress"]


def run_train(argv: list[str]) -> int:
    try:
        return cli.main([*ONE_PROCESS, *argv])
    except SystemExit as stop:
        return int(stop.code or 0)


def saved_record(directory: Path) -> RunRecord:
    return read_checkpoint(list_checkpoints(directory)[-1].path).record


def exported_tiles(folder: Path) -> None:
    """A tile folder exported from 6 slides (3 per class), 4 tiles each named <slide>_<x>_<y>.png."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for s in range(6):
        sub = folder / ("neg", "pos")[s % 2]
        sub.mkdir(parents=True, exist_ok=True)
        for x in (0, 32):
            for y in (0, 32):
                pixels = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(sub / f"slide{s}_{x}_{y}.png")


def test_a_tile_folder_exported_from_slides_splits_by_slide(tmp_path, capsys):
    exported_tiles(tmp_path / "tiles")
    code = run_train(["--app", "medical", "--datapath", str(tmp_path / "tiles"), "--val-fraction", "0.34",
                      "--checkpoint-dir", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert code == 0, err
    split = saved_record(tmp_path / "ckpt").split
    assert split is not None and split.grouping == "slide" and split.fraction == 0.34
    assert not set(split.train) & set(split.val)                    # no slide on both sides
    assert sorted(split.train + split.val) == [f"slide{s}" for s in range(6)]
    assert len(split.val) == 2                                       # one slide of each class: round(0.34 * 3)
    assert "held-out split grouped by slide" in err and "val: 2 slides, 8 images (neg 4, pos 4)" in err


def test_tiles_without_slide_names_are_named_ungrouped(tmp_path, capsys):
    from tests.support.bad_data import write_tiles

    write_tiles(tmp_path / "tiles", per_class=4, size=32)
    code = run_train(["--app", "medical", "--datapath", str(tmp_path / "tiles"), "--val-fraction", "0.5",
                      "--checkpoint-dir", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "ungrouped: tiles split one by one" in err
    split = saved_record(tmp_path / "ckpt").split
    assert split is not None and split.grouping == "ungrouped" and len(split.val) == 4


def test_group_by_that_misses_a_file_is_refused_before_work(tmp_path, capsys):
    exported_tiles(tmp_path / "tiles")
    code = run_train(["--app", "medical", "--datapath", str(tmp_path / "tiles"), "--val-fraction", "0.34",
                      "--group-by", r"case(\d+)_.*"])
    err = capsys.readouterr().err
    assert code == 2 and "--group-by" in err and "does not match 24 of 24" in err
    assert "Traceback" not in err
