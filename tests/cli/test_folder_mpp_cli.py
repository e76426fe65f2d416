"""``train --mpp`` on a tile folder and on an images/masks folder, in one process as the command runs: each image
shrunk to the MPP asked for, the checkpoint recording it, ``evaluate`` reading the data there by default; a folder
whose images carry no MPP refused before the first step naming ``--source-mpp``, which then makes it work."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from mpi4dl_nb.checkpoint.record import read_checkpoint
from mpi4dl_nb.cli import evaluate_cmd
from mpi4dl_nb.infer.model import find_checkpoint
from tests.support.segmentation_data import write_pairs
from tests.support.train_in_process import run_train

SMALL = ["--batch-size", "2", "--steps", "1", "--no-progress", "--split-size", "1", "--spatial-size", "0"]
CLASSIFIER = ["--app", "medical", "--model", "resnet", "--num-layers", "11", "--num-filters", "2",
              "--num-classes", "2", "--image-size", "32", *SMALL]


def tiles(root, mpp):
    """Two class folders of two 80 px RGB tiles each, tagged at ``mpp`` µm/px (None: untagged)."""
    rng = np.random.default_rng(0)
    for k in range(4):
        folder = root / f"class{k % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        image = Image.fromarray(rng.integers(0, 256, (80, 80, 3), dtype=np.uint8))
        image.save(folder / f"t{k}.png", **({} if mpp is None else {"dpi": (25400 / mpp, 25400 / mpp)}))
    return root


def trained_mpp(checkpoints) -> float | None:
    return read_checkpoint(find_checkpoint(checkpoints)).record.data.mpp


def test_tile_folder_without_mpp_is_refused_before_the_first_step_then_source_mpp_trains_at_mpp(tmp_path, capsys):
    data = tiles(tmp_path / "plain", None)
    code, out, err = run_train([*CLASSIFIER, "--datapath", str(data), "--mpp", "1.0",
                               "--checkpoint-dir", str(tmp_path / "refused")], capsys)
    assert code == 2 and out == "" and "--source-mpp" in err and "t0.png carries no resolution" in err
    assert not (tmp_path / "refused").exists() or not list((tmp_path / "refused").iterdir())   # no step ran
    code, _, err = run_train([*CLASSIFIER, "--datapath", str(data), "--mpp", "1.0", "--source-mpp", "0.5",
                             "--checkpoint-dir", str(tmp_path / "c")], capsys)
    assert code == 0, err
    assert trained_mpp(tmp_path / "c") == 1.0                    # 80 px at 0.5 shrunk to 40 px, then cropped
    # evaluate reads the data at the checkpoint's MPP by default: these tiles need --source-mpp for that too
    with pytest.raises(SystemExit) as stop:
        evaluate_cmd.main(["--checkpoint", str(tmp_path / "c"), "--datapath", str(data), "--split-size", "1",
                           "--spatial-size", "0"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--source-mpp" in err and "carries no resolution" in err


def test_tagged_tiles_and_masks_train_at_mpp_and_the_checkpoint_records_it(tmp_path, capsys):
    data = tiles(tmp_path / "tagged", 0.5)
    code, _, err = run_train([*CLASSIFIER, "--datapath", str(data), "--mpp", "1.0",
                             "--checkpoint-dir", str(tmp_path / "c")], capsys)
    assert code == 0, err
    assert trained_mpp(tmp_path / "c") == 1.0
    code, _, err = run_train([*CLASSIFIER, "--datapath", str(data), "--mpp", "2.0"], capsys)   # 80 px -> 20 px
    assert code == 2 and "t0.png is 80x80, 20x20 at 2 µm/px: smaller than --image-size 32" in err

    pairs = write_pairs(tmp_path / "pairs", count=4, size=48)
    for path in (pairs / "images").iterdir():
        Image.open(path).save(path, dpi=(25400 / 0.5, 25400 / 0.5))
    segmentation = ["--task", "segmentation", "--model", "unet", "--num-layers", "2", "--num-filters", "2",
                    "--datapath", str(pairs), "--num-classes", "3", "--image-size", "32", *SMALL]
    code, _, err = run_train([*segmentation, "--mpp", "0.75", "--checkpoint-dir", str(tmp_path / "s")], capsys)
    assert code == 0, err
    assert trained_mpp(tmp_path / "s") == 0.75                   # 48 px shrunk to 32, masks by majority label
