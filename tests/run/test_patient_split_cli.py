"""A tile folder named by TCGA barcodes, from the command line (one process: what is checked is who lands on which
side and what is reported): two slides per patient, no patient on both sides of ``--val-fraction`` (the checkpoint's
record and the printed counts), and ``evaluate`` of the three classes reporting the one-vs-rest macro AUC of its
tiles' logits; a slide whose tiles lie in two class folders refused before work."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mpi4dl_nb.checkpoint.files import list_checkpoints
from mpi4dl_nb.checkpoint.record import read_checkpoint
from mpi4dl_nb.cli import evaluate_cmd, train_cmd
from mpi4dl_nb.evaluation import evaluator
from tests.evaluation.test_metrics import direct_one_vs_rest
from tests.support.train_in_process import run_command

CLASSES = ("a", "b", "c")
ONE_PROCESS = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4",
               "--image-size", "32", "--split-size", "1", "--spatial-size", "0", "--batch-size", "4",
               "--steps", "1", "--no-progress", "--dtype", "float64"]


def tcga_tiles(root: Path) -> list[str]:
    """Two patients per class, two slides per patient (DX1, DX2), two 32x32 tiles per slide; the patients."""
    from PIL import Image

    rng = np.random.default_rng(0)
    patients = []
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for p in range(2):
            patient = f"TCGA-A{c}-00P{p}"
            patients.append(patient)
            for slide in ("DX1", "DX2"):
                for x in (0, 32):
                    pixels = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)
                    Image.fromarray(pixels).save(root / name / f"{patient}-01Z-00-{slide}.ABCD_{x}_0.png")
    return patients


def test_tcga_tiles_split_by_patient_and_three_classes_report_a_macro_auc(tmp_path, capsys, monkeypatch):
    patients = tcga_tiles(tmp_path / "tiles")
    code, _, err = run_command(train_cmd.main, [*ONE_PROCESS, "--app", "medical", "--datapath",
                                                str(tmp_path / "tiles"), "--val-fraction", "0.5",
                                                "--checkpoint-dir", str(tmp_path / "ckpt")], capsys)
    assert code == 0, err
    split = read_checkpoint(list_checkpoints(tmp_path / "ckpt")[-1].path).record.split
    assert split is not None and split.grouping == "patient" and split.group_by is None
    assert sorted(split.train + split.val) == sorted(patients) and not set(split.train) & set(split.val)
    assert len(split.val) == 3                                              # one patient of each class
    assert "held-out split grouped by patient (from TCGA barcodes)" in err, err
    assert "  val: 3 patients, 6 slides, 12 images (a 4, b 4, c 4)" in err, err

    seen = []

    def kept(records, *args):
        seen.append(records)
        return summarize(records, *args)

    summarize = evaluator.summarize
    monkeypatch.setattr(evaluator, "summarize", kept)
    code, out, err = run_command(evaluate_cmd.main, ["--checkpoint", str(tmp_path / "ckpt"), "--split-size", "1",
                                                     "--spatial-size", "0"], capsys)
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["count"] == 12 and result["patient"]["count"] == 3          # the recorded split, rebuilt
    (records,) = seen
    expected = direct_one_vs_rest(records.logits.tolist(), records.label.tolist())
    assert result["per_class_roc_auc"] == pytest.approx(expected, abs=1e-12)
    assert result["roc_auc"] == pytest.approx(sum(expected) / 3, abs=1e-12)
    assert result["roc_auc_by_class"] == dict(zip(CLASSES, result["per_class_roc_auc"], strict=True))

    clash = tmp_path / "clash"
    for name, stem in (("a", "s0_0_0"), ("b", "s0_32_0"), ("c", "s1_0_0")):   # slide s0 in a/ and in b/
        (clash / name).mkdir(parents=True)
        shutil.copy(next((tmp_path / "tiles" / name).iterdir()), clash / name / f"{stem}.png")
    code, out, err = run_command(evaluate_cmd.main, ["--checkpoint", str(tmp_path / "ckpt"), "--split-size", "1",
                                                     "--spatial-size", "0", "--datapath", str(clash), "--all-data"],
                                 capsys)
    assert code == 2 and not out and "Traceback" not in err, err
    assert f"--datapath: slide 's0' has tiles in {clash / 'a'}/ and {clash / 'b'}/" in err, err


def test_a_one_patient_folder_s_refusal_names_the_patient_and_group_by_slide(tmp_path, capsys):
    """Issue 91: a TCGA folder of one patient (a slide in each class folder): whatever --val-fraction, the refusal
    names the patient and --group-by slide (not "raise --val-fraction"); with it, each class is one slide: named."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for name, slide in (("a", "DX1"), ("b", "DX2")):
        (tmp_path / "one" / name).mkdir(parents=True)
        for x in (0, 32, 64):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(
                tmp_path / "one" / name / f"TCGA-A0-00P0-01Z-00-{slide}.ABCD_{x}_0.png")
    flags = [*ONE_PROCESS, "--app", "medical", "--datapath", str(tmp_path / "one")]
    for fraction in ("0.25", "0.9"):
        code, _, err = run_command(train_cmd.main, [*flags, "--val-fraction", fraction], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, err
        assert "every image is of one patient, TCGA-A0-00P0" in lines[0] and "--group-by slide" in lines[0], err
        assert "raise --val-fraction" not in lines[0]
    code, _, err = run_command(train_cmd.main, [*flags, "--val-fraction", "0.5", "--group-by", "slide"], capsys)
    assert code == 2 and "class a is all slide TCGA-A0-00P0-01Z-00-DX1; class b is all slide" in err, err
