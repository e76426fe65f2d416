"""Cohorts and leak-free splits from the command line (one process: what is checked is who lands on which side,
not exactness across ranks): tile folders grouped by slide, cohort manifests grouped by patient."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

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
    # evaluate without data flags: the recorded folder and split (not the bundled sample), slides from tile names
    import json

    from mpi4dl_nb.cli import evaluate_cmd

    assert evaluate_cmd.main(["--checkpoint", str(tmp_path / "ckpt"), "--split-size", "1", "--spatial-size", "0"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["count"] == 8 and result["slide"]["count"] == 2 and "patient" not in result


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


# ----------------------------------------------------------------- --cohort FILE.csv
def cohort_slides(folder: Path, count: int = 12) -> list[Path]:
    """``count`` small pyramidal slides that OpenSlide opens (64x64, two levels, all tissue-coloured)."""
    from tests.support.pyramid import write_pyramid

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    paths = []
    for s in range(count):
        pixels = rng.integers(60, 200, (64, 64, 3), dtype=np.uint8)
        pixels[..., 1] //= 2                                          # pink enough to count as tissue
        path = folder / f"s{s}.tif"
        write_pyramid(path, pixels, levels=2, tile=32)
        paths.append(path)
    return paths


def cohort_rows() -> list[str]:
    """12 slides of 6 patients (2 each, one label per patient: 3 neg and 3 pos patients), folds by patient."""
    return [f"wsi/s{s}.tif,{('neg', 'pos')[(s // 2) % 2]},P{s // 2},{(s // 2) % 3}" for s in range(12)]


def write_cohort(folder: Path, rows: list[str]) -> Path:
    path = folder / "cohort.csv"
    path.write_text("slide,label,patient,fold\n" + "\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def slides_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cohort")
    cohort_slides(root / "wsi")
    return root


def test_a_bad_cohort_is_refused_before_the_first_step_naming_its_lines(slides_folder, capsys):
    rows = cohort_rows()
    rows[3] = "wsi/gone.tif,pos,P1,1"                 # line 5: a missing file
    rows[6] = "wsi/s6.tif,maybe,P3,0"                 # line 8: a label not among --classes
    rows[10] = "wsi/s10.tif,neg,P5,0"                 # line 12: P5's slides in folds 0 and 2
    path = write_cohort(slides_folder, rows)
    code = run_train(["--cohort", str(path), "--classes", "neg,pos", "--val-fraction", "0.34"])
    err = capsys.readouterr().err
    assert code == 2 and "--cohort" in err and "3 problems" in err, err
    assert "line 5" in err and "gone.tif" in err and "line 8" in err and "maybe" in err and "line 12" in err
    assert "step 1" not in err and "Traceback" not in err


def test_a_class_no_slide_carries_is_refused(slides_folder, capsys):
    """``--classes`` naming a class no slide is labelled with would train an output nothing teaches: refused before
    work, as a missing class folder is, naming the class and the fix."""
    code = run_train(["--cohort", str(write_cohort(slides_folder, cohort_rows())), "--classes", "neg,pos,other"])
    err = capsys.readouterr().err
    assert code == 2 and "--classes: other: no slide of" in err and "drop it (--classes neg,pos)" in err, err
    assert "step 1" not in err and "Traceback" not in err


@pytest.fixture(scope="module")
def trained_cohort(slides_folder, tmp_path_factory):
    """One process, 2 steps on the 12-slide cohort, a third of the patients held out."""
    import contextlib
    import io

    path = write_cohort(slides_folder, cohort_rows())
    ckpt = tmp_path_factory.mktemp("cohort-run") / "ckpt"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run_train(["--cohort", str(path), "--val-fraction", "0.34", "--checkpoint-dir", str(ckpt),
                          "--dtype", "float64", "--steps", "2", "--log-dir", str(ckpt.parent / "log")])
    assert code == 0, err.getvalue()
    return path, ckpt, err.getvalue()


def test_val_fraction_on_a_cohort_keeps_every_patient_on_one_side(trained_cohort):
    from mpi4dl_nb.data.cohort_slides import CohortSlides
    from mpi4dl_nb.data.groups import groups_of
    from mpi4dl_nb.data.manifest import read_cohort
    from mpi4dl_nb.run.job_data import grouped_held_out

    path, ckpt, err = trained_cohort
    record = saved_record(ckpt)
    split = record.split
    assert split is not None and split.grouping == "patient" and record.data.cohort == str(path.resolve())
    assert sorted(split.train + split.val) == [f"P{p}" for p in range(6)] and len(split.val) == 2
    assert record.class_names == ("neg", "pos")
    assert "held-out split grouped by patient" in err and "val: 2 patients, 4 slides" in err
    # every tile cut from a patient's slides is on its patient's side, labelled by its slide
    data = CohortSlides(read_cohort(path), 32)
    groups = groups_of(data)
    again = grouped_held_out(data, 0.34, 0, 2, groups)
    assert {groups.names[i] for i in again.val} == set(split.val)
    assert {groups.names[i] for i in again.train} == set(split.train)
    assert {groups.slides[i] for i in again.val}.isdisjoint(groups.slides[i] for i in again.train)
    labels = {s.name: s.label for s in read_cohort(path)}
    assert all(data.classes[data.label(i)] == labels[groups.slides[i]] for i in range(len(data)))


def hand_auc(scores: list[float], positive: list[bool]) -> float:
    """AUC as the share of (positive, negative) pairs ranked right, ties half."""
    pairs = [(p, n) for p, yp in zip(scores, positive) if yp for n, yn in zip(scores, positive) if not yn]
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)


def test_evaluate_cohort_reports_tile_slide_and_patient_levels(trained_cohort, tmp_path, capsys):
    import csv
    import json

    from mpi4dl_nb.cli import evaluate_cmd

    path, ckpt, _ = trained_cohort
    table = tmp_path / "slides.csv"
    code = evaluate_cmd.main(["--checkpoint", str(ckpt), "--cohort", str(path), "--slide-csv", str(table),
                              "--split-size", "1", "--spatial-size", "0"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    record = saved_record(ckpt)
    assert record.split is not None
    rows = list(csv.DictReader(table.open()))
    assert sorted({r["patient"] for r in rows}) == sorted(record.split.val)        # the held-out patients only
    assert len(rows) == 4 and result["slide"]["count"] == 4 and result["patient"]["count"] == 2
    assert result["aggregate"] == "mean" and "roc_auc" in result
    by_hand = hand_auc([float(r["prob_pos"]) for r in rows], [r["label"] == "pos" for r in rows])
    assert result["slide"]["roc_auc"] == pytest.approx(by_hand, abs=1e-12)
    assert all(r["predicted"] == ("pos" if float(r["prob_pos"]) > float(r["prob_neg"]) else "neg") for r in rows)
    assert "tile" in err and "slide" in err and "patient" in err                # the table before the JSON


def test_training_logs_slide_and_patient_levels_as_evaluate_reports_them(trained_cohort, capsys):
    import json

    from mpi4dl_nb.cli import evaluate_cmd

    _, ckpt, err = trained_cohort
    logged = [json.loads(line) for line in (ckpt.parent / "log" / "metrics.jsonl").read_text().splitlines()]
    last = [row for row in logged if row["kind"] == "eval"][-1]
    assert last["step"] == 2 and last["val_slide"]["count"] == 4 and last["val_patient"]["count"] == 2
    assert "slide_roc_auc" in err and "patient_balanced_accuracy" in err             # the eval line says them
    assert evaluate_cmd.main(["--checkpoint", str(ckpt), "--split-size", "1", "--spatial-size", "0"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for level in ("slide", "patient"):
        got, logged_level = dict(result[level]), dict(last[f"val_{level}"])
        assert got.pop("confusion_matrix") == logged_level.pop("confusion_matrix"), level
        assert got == pytest.approx(logged_level, abs=1e-12), level


def test_evaluate_without_data_flags_uses_the_recorded_cohort(trained_cohort, capsys):
    import json

    from mpi4dl_nb.cli import evaluate_cmd

    _, ckpt, _ = trained_cohort
    code = evaluate_cmd.main(["--checkpoint", str(ckpt), "--aggregate", "max", "--split-size", "1",
                              "--spatial-size", "0"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["app"] == "medical" and result["slide"]["count"] == 4 and result["aggregate"] == "max"


def test_folds_run_every_fold_and_partition_the_patients(slides_folder, tmp_path, capsys):
    import json

    path = write_cohort(slides_folder, cohort_rows())
    code = run_train(["--cohort", str(path), "--folds", "3", "--checkpoint-dir", str(tmp_path / "ckpt")])
    out, err = capsys.readouterr()
    assert code == 0, err
    held: list[str] = []
    for fold in range(3):
        split = saved_record(tmp_path / "ckpt" / f"fold-{fold}").split
        assert split is not None and (split.folds, split.fold, split.grouping) == (3, fold, "patient")
        assert not set(split.train) & set(split.val) and len(split.train + split.val) == 6
        assert split.val == tuple(f"P{p}" for p in range(6) if p % 3 == fold)     # the manifest's fold column
        held += split.val
    assert sorted(held) == [f"P{p}" for p in range(6)]                          # the folds partition the patients
    report = json.loads(out.strip().splitlines()[-1])
    assert report["folds"] == 3 and len(report["metrics"]["val_accuracy"]["values"]) == 3
    assert "val_accuracy" in err and "over 3 folds" in err


def test_fold_flags_are_checked_before_work(slides_folder, capsys):
    path = write_cohort(slides_folder, cohort_rows())
    for argv, words in ((["--fold", "1"], "--fold: picks one of --folds K"),
                        (["--folds", "3", "--fold", "3"], "--fold: must be one of 0..2"),
                        (["--folds", "3", "--val-fraction", "0.3"], "--folds: holds out each fold in turn"),
                        (["--folds", "2"], "the manifest's fold column has 2; give --folds 3")):
        assert run_train(["--cohort", str(path), *argv]) == 2
        assert words in capsys.readouterr().err


def test_the_manifest_split_column_gives_the_sides(slides_folder, tmp_path, capsys):
    sides = {0: "train", 1: "train", 2: "val", 3: "val", 4: "test", 5: "test"}    # by patient (P0 neg, P1 pos, ..)
    rows = [f"wsi/s{s}.tif,{('neg', 'pos')[(s // 2) % 2]},P{s // 2},{sides[s // 2]}" for s in range(12)]
    path = slides_folder / "sides.csv"
    path.write_text("slide,label,patient,split\n" + "\n".join(rows) + "\n")
    assert run_train(["--cohort", str(path), "--val-fraction", "0.3"]) == 2
    assert "--val-fraction: the cohort's split column already places each patient" in capsys.readouterr().err
    ckpt = tmp_path / "ckpt"
    assert run_train(["--cohort", str(path), "--checkpoint-dir", str(ckpt), "--steps", "1"]) == 0
    err = capsys.readouterr().err
    split = saved_record(ckpt).split
    assert split is not None and split.train == ("P0", "P1") and split.val == ("P2", "P3")   # test patients: neither
    assert "train: 2 patients, 4 slides" in err and "val: 2 patients, 4 slides" in err
