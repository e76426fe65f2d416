"""The acceptance runs: train with a held-out split, evaluation figures and metrics.jsonl on 5 ranks;
``evaluate`` of its checkpoint on 5 ranks (SP+LP) and in one process agree (float64); bad input refused."""
from __future__ import annotations

from pathlib import Path

import pytest

from mpi4dl_nb.cli import evaluate_cmd
from mpi4dl_nb.cli import train_cmd as cli
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.evaluation.log import read_metrics
from tests.support.bad_data import write_tiles
from tests.support.summary import json_record

MODEL = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4",
         "--image-size", "32", "--dtype", "float64"]
SP_LP = ["--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "4"]


def evaluation_record(output: str) -> dict:
    return json_record(output, '{"checkpoint"')


@pytest.fixture(scope="module")
def trained(tmp_path_factory, request):
    """5 ranks (SP+LP): 16 IHC tiles, 2 classes, a quarter held out, evaluation every 2 steps."""
    from tests.support.mpirun import run_mpi

    root = tmp_path_factory.mktemp("evaluate")
    write_tiles(root / "tiles", per_class=8, size=32)
    data = ["--app", "medical", "--datapath", str(root / "tiles"), "--num-classes", "2"]
    result = run_mpi(5, "mpi4dl_nb", "train", *MODEL, *SP_LP, *data, "--batch-size", "4", "--steps", "4",
                     "--val-fraction", "0.25", "--eval-every", "2", "--log-dir", str(root / "log"),
                     "--checkpoint-dir", str(root / "ckpt"), module=True, timeout=400)
    return root, data, result


@pytest.mark.mpi
def test_train_reports_validation_and_logs_every_step(trained):
    root, _, result = trained
    summary = json_record(result.stdout)
    assert summary["val_step"] == 4 and summary["val_count"] == 4 and summary["val_fraction"] == 0.25
    assert 0 <= summary["val_accuracy"] <= 1 and summary["val_loss"] > 0
    assert sum(map(sum, summary["val_confusion_matrix"])) == 4 and len(summary["val_per_class_recall"]) == 2
    # 12 training tiles, batch 4: epochs end at steps 3; evaluation at 2, 3 (epoch end) and 4 (every 2, end)
    assert [line.split("eval at step ")[1].split(" ")[0] for line in result.stdout.splitlines()
            if "eval at step" in line] == ["2", "3", "4"]
    records = read_metrics(root / "log")
    assert [(r["kind"], r["step"]) for r in records] == [
        ("train", 1), ("train", 2), ("eval", 2), ("train", 3), ("eval", 3), ("train", 4), ("eval", 4)]
    assert records[-1]["val_loss"] == summary["val_loss"] and records[0]["loss"] == summary["losses"][0]


@pytest.mark.mpi
def test_evaluate_on_5_ranks_equals_one_process(trained, capsys):
    root, data, _ = trained
    from tests.support.mpirun import run_mpi

    run = run_mpi(5, "mpi4dl_nb", "evaluate", "--checkpoint", str(root / "ckpt"), *SP_LP, *data, module=True,
                  timeout=300)
    parallel = evaluation_record(run.stdout)
    assert evaluate_cmd.main(["--checkpoint", str(root / "ckpt"), "--split-size", "1", "--spatial-size", "0",
                              "--device", "cpu", *data]) == 0
    said = capsys.readouterr()
    serial = evaluation_record(said.out)
    # the progress line on stderr, rank 0's only (4 held-out images: one batch of the run's 4); the job's output
    # holds every rank's stdout and stderr, each line after its rank
    line = "[##############################] evaluate batch 1/1 images 4/4"
    for output, expected in ((run.stdout, f"[0] {line}"), (said.err, line)):
        assert [text.split(" img/s")[0].rsplit(" ", 1)[0] for text in output.splitlines()
                if "evaluate batch" in text] == [expected], output
    summary = json_record(trained[2].stdout)
    assert parallel["world_size"] == 5 and serial["world_size"] == 1 and parallel["dtype"] == "float64"
    assert parallel["split"] == serial["split"] and parallel["split"].startswith("fraction 0.25, seed 0, 4 images")
    assert abs(parallel["loss"] - serial["loss"]) < 1e-9 and abs(parallel["loss"] - summary["val_loss"]) < 1e-9
    for key in ("accuracy", "confusion_matrix", "per_class_recall", "roc_auc", "count"):
        assert parallel[key] == serial[key] == summary[f"val_{key}"], key


@pytest.mark.mpi
def test_memory_mapped_load_gives_the_eager_metrics(trained, capsys, monkeypatch):
    """evaluate maps the checkpoint (reads only the model's weights): the same record as loading it whole."""
    from mpi4dl_nb.checkpoint import files as ck

    root, data, _ = trained
    argv = ["--checkpoint", str(root / "ckpt"), "--split-size", "1", "--spatial-size", "0", *data]
    assert evaluate_cmd.main(argv) == 0
    mapped = evaluation_record(capsys.readouterr().out)
    eager_load, calls = ck.load_checkpoint, []

    def eager(path, map_location="cpu", *, lazy=False, check=True):
        calls.append(lazy)
        return eager_load(path, map_location, lazy=False, check=True)
    monkeypatch.setattr(ck, "load_checkpoint", eager)
    assert evaluate_cmd.main([*argv, "--no-progress"]) == 0
    said = capsys.readouterr()
    whole = evaluation_record(said.out)
    assert "evaluate batch" not in said.err
    assert calls == [True, True]      # evaluate maps the file for its record, then for the weights (after the data)
    mapped.pop("seconds"), whole.pop("seconds")
    assert mapped == whole and mapped["count"] == 4


@pytest.mark.mpi
def test_mapped_load_still_refuses_damaged_or_mismatched_checkpoints(trained, tmp_path, capsys):
    """The checksum (rank 0) and the weights-fit-description check hold for the mapped load."""
    import shutil

    import torch

    from mpi4dl_nb.checkpoint import files as ck
    from mpi4dl_nb.infer.model import load_trained
    from tests.support.bad_data import flip_bytes

    root, data, _ = trained
    source = ck.latest_checkpoint(root / "ckpt")
    payload = ck.load_checkpoint(source)
    assert "optimizer" in payload and payload["optimizer"]
    maps = Path("/proc/self/maps")
    if maps.exists():                              # mapped, not read: the file is in this process's address space
        mapped = ck.load_checkpoint(source, lazy=True)
        assert str(source) in maps.read_text()
        del mapped
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for file in (source, ck.manifest_path(source)):
        shutil.copy(file, damaged / file.name)
    flip_bytes(damaged / source.name, at=0.5)
    with pytest.raises(SystemExit) as stop:
        evaluate_cmd.main(["--checkpoint", str(damaged), "--split-size", "1", "--spatial-size", "0", *data])
    said = capsys.readouterr().err
    assert stop.value.code == 2 and "is damaged: checksum mismatch" in said
    assert "mpi4dl_nb evaluate: error:" in said and "mpi4dl_nb train" not in said, said   # the command that failed
    lacking = dict(payload, model={k: v for k, v in payload["model"].items() if k != "0.conv.weight"})
    for key in ("step", "run_id", "identity", "format_version"):
        lacking.pop(key)
    saved = ck.save_checkpoint(tmp_path / "lacking", int(payload["step"]), lacking, run_id="0123456789ab",
                               identity=payload["identity"])
    with pytest.raises(ValueError, match="weights do not fit its own description.*missing \\['0.conv.weight'\\]"):
        load_trained(saved, dtype=torch.float64)
    reshaped = dict(lacking, model=dict(payload["model"]))
    reshaped["model"]["0.conv.weight"] = payload["model"]["0.conv.weight"][:1].clone()
    saved = ck.save_checkpoint(tmp_path / "reshaped", int(payload["step"]), reshaped, run_id="0123456789ab",
                               identity=payload["identity"])
    with pytest.raises(ValueError, match="weights do not fit its own description.*size mismatch for 0.conv.weight"):
        load_trained(saved, dtype=torch.float64)


@pytest.mark.mpi
def test_evaluate_refuses_another_model_and_another_split(trained, capsys):
    root, data, _ = trained
    one = ["--checkpoint", str(root / "ckpt"), "--split-size", "1", "--spatial-size", "0"]
    with pytest.raises(SystemExit) as stop:
        evaluate_cmd.main([*one, *data[:-2], "--num-classes", "3"])
    assert stop.value.code == 2 and "checkpoint of another model (num_classes 2, not 3)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate_cmd.main([*one, *data, "--model", "amoebanet"])
    assert "holds a resnet network, not amoebanet" in capsys.readouterr().err
    with pytest.raises(SystemExit):                       # the training run's split, on other data
        evaluate_cmd.main([*one, "--app", "synthetic", "--num-samples", "16"])
    assert "held-out images differ from the training run's" in capsys.readouterr().err


@pytest.mark.parametrize("argv,words", [
    (["--val-fraction", "0"], "--val-fraction: must lie strictly between 0 and 1"),
    (["--val-fraction", "1"], "--val-fraction: must lie strictly between 0 and 1"),
    (["--val-fraction", "0.2", "--val-datapath", "/x"], "not both"),
    (["--eval-every", "5"], "--eval-every: needs validation data"),
    (["--eval-every", "-1"], "--eval-every: must be a number >= 0"),
    (["--val-datapath", "/x"], "--val-datapath: --app synthetic reads no files"),
])
def test_bad_evaluation_flags_refused(argv, words):
    args = cli.train_parser().parse_args(argv)
    with pytest.raises(ConfigError) as err:
        cli.train_plan(args)
    assert words in str(err.value)


def test_too_few_validation_samples_refused_before_training(capsys):
    code = None
    try:
        code = cli.main([*MODEL, "--split-size", "1", "--spatial-size", "0", "--num-samples", "8",
                         "--batch-size", "2", "--num-classes", "4", "--val-fraction", "0.1", "--no-progress"])
    except SystemExit as stop:
        code = stop.code
    assert code == 2 and "fewer than the 4 classes" in capsys.readouterr().err


def test_evaluate_refuses_a_too_fine_spatial_split_while_loading(tmp_path, capsys):
    """The layout check train does (halos against tiles) runs in evaluate's agreed load stage too: on 1x4
    columns of 16 px the default cut keeps the cells wider than a tile on the layer rank (2,7), and a
    ``--balance`` that puts them on the tiles is refused, naming that cut."""
    from types import SimpleNamespace

    from mpi4dl_nb.run.evaluate_run import Evaluation

    model = ["--model", "amoebanet", "--num-layers", "3", "--num-filters", "8", "--image-size", "64"]
    assert cli.main([*model, "--batch-size", "2", "--num-samples", "4", "--no-progress", "--split-size", "1",
                     "--spatial-size", "0", "--steps", "1", "--checkpoint-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    for flags, refused in ((["--slice-method", "square"], False), (["--slice-method", "vertical"], False),
                           (["--slice-method", "vertical", "--balance", "6,3"], True)):
        args = evaluate_cmd.evaluate_parser().parse_args(["--checkpoint", str(tmp_path), *flags])
        evaluation = Evaluation(evaluate_cmd.evaluate_plan(args), ctx=SimpleNamespace(rank=0))
        evaluation.read()
        if not refused:
            evaluation.load()
            continue
        with pytest.raises(ConfigError, match="the halo is wider than a tile.*--balance 2,7 fits"):
            evaluation.load()
