"""Evaluation reads images as training read them: a run trained with ``--stain-normalize`` on a cohort from two
labs (two stains) is evaluated by ``evaluate`` and ``dl.evaluate`` through the checkpoint's normaliser, giving the
figures of the run's own held-out evaluation; ``--no-stain-normalize`` / ``stain_normalize=False`` read the images
as stored (other figures); a checkpoint without the field evaluates as stored; a corrupt field is refused
(one process, float64)."""
from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mpi4dl_nb.checkpoint.record import RECORD_KEY, read_checkpoint
from mpi4dl_nb.cli import evaluate_cmd
from mpi4dl_nb.data import ihc_image
from mpi4dl_nb.data.stain_reads import stain_of
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.infer.model import find_checkpoint
from mpi4dl_nb.run.evaluate import evaluate
from tests.support.pyramid import write_pyramid
from tests.support.summary import json_record

ONE_PROCESS = ["--split-size", "1", "--spatial-size", "0"]
TRAIN = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4",
         "--image-size", "32", *ONE_PROCESS, "--batch-size", "2", "--steps", "1", "--dtype", "float64",
         "--no-progress"]
OTHER_LAB = np.array([1.0, 0.62, 0.85])     # the second lab's slides: greener and bluer channels absorbed more


def two_lab_cohort(root: Path) -> Path:
    """8 slides (64x64 crops of the IHC sample) of 4 patients, 2 per patient; patients P2, P3 from another lab
    (another stain); labels neg/pos alternate by patient."""
    image = ihc_image()
    (root / "wsi").mkdir(parents=True)
    rows = []
    for s in range(8):
        crop = image[64 * s:64 * s + 64, 128:192].astype(np.float64)
        if s >= 4:
            crop = crop * OTHER_LAB
        write_pyramid(root / "wsi" / f"s{s}.tif", np.round(crop).astype(np.uint8), levels=2, tile=32)
        rows.append(f"wsi/s{s}.tif,{('neg', 'pos')[(s // 2) % 2]},P{s // 2}")
    path = root / "cohort.csv"
    path.write_text("slide,label,patient\n" + "\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    """(checkpoint directory, the training run's JSON summary): Macenko to a tile of the first lab, half of the
    patients held out and evaluated at the end of the run."""
    from mpi4dl_nb.cli import train_cmd

    root = tmp_path_factory.mktemp("evalstain")
    cohort = two_lab_cohort(root)
    Image.fromarray(ihc_image()[256:384, 256:384]).save(root / "reference.png")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train_cmd.main([*TRAIN, "--cohort", str(cohort), "--val-fraction", "0.5", "--checkpoint-dir",
                               str(root / "ck"), "--stain-normalize", "macenko", "--stain-reference",
                               str(root / "reference.png")])
    assert code == 0, err.getvalue()
    return root / "ck", json_record(out.getvalue())


def evaluated(capsys: pytest.CaptureFixture[str], checkpoint: Path, *flags: str) -> tuple[dict, str]:
    """``evaluate --checkpoint checkpoint *flags`` in this process: (its JSON line, what it printed on stderr)."""
    code = evaluate_cmd.main(["--checkpoint", str(checkpoint), *ONE_PROCESS, *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.fixture(scope="module")
def as_stored(trained) -> tuple[dict, str]:
    """``evaluate --no-stain-normalize`` of the run: (its JSON line, its stderr)."""
    checkpoint, _ = trained
    capture = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(capture):
        assert evaluate_cmd.main(["--checkpoint", str(checkpoint), *ONE_PROCESS, "--no-stain-normalize"]) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1]), capture.getvalue()


@pytest.fixture(scope="module")
def held(trained):
    """The run's held-out images, read as stored (the split the checkpoint records)."""
    return held_out_as_stored(trained[0])


def held_out_as_stored(checkpoint: Path):
    """The held-out images of the run of ``checkpoint``, read as stored."""
    from mpi4dl_nb.run.evaluate_job import EvaluateJob, EvaluatePlan
    from mpi4dl_nb.run.evaluate_run import resolved_data, resolved_held_out
    from mpi4dl_nb.run.job_data import dataset_from, held_out_data

    record = read_checkpoint(find_checkpoint(checkpoint)).record
    job = EvaluatePlan(EvaluateJob.of(checkpoint=str(checkpoint), split_size=1, spatial_size=0), str(checkpoint))
    data, held_out = replace(resolved_data(job, record), stain=None), resolved_held_out(job, record)
    _, held, _, _ = held_out_data(data, held_out, record.seed, dataset_from(data, record.seed, data.datapath))
    assert held is not None
    return held


def rewritten(checkpoint: Path, target: Path, stain: object) -> Path:
    """A copy of ``checkpoint``'s newest file whose record's stain field is ``stain`` (``KeyError``: no field, as
    written before stain normalisation existed); no manifest, so it loads unchecked."""
    payload = torch.load(find_checkpoint(checkpoint), weights_only=True)
    record = dict(payload[RECORD_KEY])
    if stain is KeyError:
        del record["stain"]
    else:
        record["stain"] = stain
    payload[RECORD_KEY] = record
    torch.save(payload, target)
    return target


def test_evaluate_reads_as_training_read_and_no_stain_normalize_reads_as_stored(trained, as_stored, capsys):
    checkpoint, summary = trained
    record = read_checkpoint(find_checkpoint(checkpoint)).record
    assert record.stain is not None and record.stain.reference == "reference.png"
    assert summary["val_count"] == 16                       # 2 held-out patients, 2 slides each, 4 tiles a slide
    normalised, err = evaluated(capsys, checkpoint)
    assert normalised["count"] == summary["val_count"]
    assert normalised["loss"] == pytest.approx(summary["val_loss"], rel=1e-12, abs=0)
    assert normalised["confusion_matrix"] == summary["val_confusion_matrix"]
    assert normalised["roc_auc"] == pytest.approx(summary["val_roc_auc"], abs=1e-12)
    assert normalised["stain"] == record.stain.describe()
    assert err.count("stain normalisation:") == 1
    assert (f"stain normalisation: macenko fitted on reference.png [{record.stain.fingerprint}] "
            f"(from the checkpoint)") in err
    stored, err = as_stored
    assert stored["count"] == summary["val_count"] and stored["stain"] == "off"
    assert abs(stored["loss"] - summary["val_loss"]) > 1e-6 * summary["val_loss"], "normalisation changed nothing"
    assert "stain normalisation: off (--no-stain-normalize; the run trained on images normalised by macenko" in err


def test_dl_evaluate_reads_through_the_checkpoints_normaliser(trained, as_stored, held, capsys):
    checkpoint, summary = trained
    metrics = evaluate(checkpoint, held)
    assert metrics.count == summary["val_count"]
    assert metrics.loss == pytest.approx(summary["val_loss"], rel=1e-12, abs=0)
    assert metrics.as_dict()["confusion_matrix"] == summary["val_confusion_matrix"]
    assert metrics.roc_auc == pytest.approx(summary["val_roc_auc"], abs=1e-12)
    assert "(from the checkpoint)" in capsys.readouterr().err
    assert stain_of(held.dataset) is None                   # the caller's dataset reads as stored again
    stored = evaluate(checkpoint, held, stain_normalize=False)
    assert abs(stored.loss - summary["val_loss"]) > 1e-6 * summary["val_loss"], "normalisation changed nothing"
    assert "stain normalisation: off (stain_normalize=False" in capsys.readouterr().err
    assert stored.loss == pytest.approx(as_stored[0]["loss"], rel=1e-12, abs=0)


def test_a_checkpoint_without_the_field_evaluates_as_stored(trained, as_stored, held, tmp_path, capsys):
    checkpoint, _ = trained
    old = rewritten(checkpoint, tmp_path / "step-1.pt", KeyError)
    assert read_checkpoint(old).record.stain is None
    stored, _ = as_stored
    result, err = evaluated(capsys, old)
    assert result["stain"] == "none" and "stain normalisation" not in err
    assert result["loss"] == stored["loss"] and result["confusion_matrix"] == stored["confusion_matrix"]
    assert evaluate(old, held).loss == pytest.approx(stored["loss"], rel=1e-12, abs=0)
    assert "stain normalisation" not in capsys.readouterr().err


def test_a_corrupt_stain_field_is_refused_before_work(trained, held, tmp_path, capsys):
    checkpoint, _ = trained
    broken = rewritten(checkpoint, tmp_path / "step-1.pt", {"method": "macenko", "first": [0.5, 0.5], "second": [1.0]})
    with pytest.raises(SystemExit) as stop:
        evaluate_cmd.main(["--checkpoint", str(broken), *ONE_PROCESS])
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == ""
    assert "--checkpoint" in err and str(broken) in err and "cannot be rebuilt" in err and "--stain-normalize" in err
    assert "macenko keeps 6 and 2 numbers" in err and "Traceback" not in err
    with pytest.raises(ConfigError, match="checkpoint: .*step-1.pt records a stain normaliser that cannot be rebuilt"):
        evaluate(broken, held)


def test_data_without_stains_is_refused_naming_the_switch(trained, capsys):
    from mpi4dl_nb.data import SyntheticDataset

    checkpoint, _ = trained
    with pytest.raises(ConfigError, match=r"stain_normalize=False: .*SyntheticDataset has none"):
        evaluate(checkpoint, SyntheticDataset(32, num_classes=2, num_samples=4))
    with pytest.raises(SystemExit) as stop:
        evaluate_cmd.main(["--checkpoint", str(checkpoint), *ONE_PROCESS, "--app", "synthetic",
                           "--num-samples", "4", "--all-data"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--no-stain-normalize: " in err and "--app synthetic has none" in err
