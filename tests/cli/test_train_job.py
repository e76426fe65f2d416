"""The job seam: one TrainJob from ``train``'s flags or from Python keyword arguments (the same job, the same
checkpoint record); nothing after the builder reads an argparse Namespace; ``val_loss`` is the run's loss."""
from __future__ import annotations

import argparse
import ast
from dataclasses import replace
from pathlib import Path

import pytest

import mpi4dl_nb as dl
from mpi4dl_nb.cli import evaluate_cmd
from mpi4dl_nb.cli import train_cmd as cli
from mpi4dl_nb.cli.setup import parse_launch
from mpi4dl_nb.cli.train_job import job_from_keywords, train_job
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.run.job import TrainJob
from tests.support.bad_data import write_tiles
from tests.support.summary import json_record

PACKAGE = Path(dl.__file__).parent
FLAGS = ("--model resnet --resnet-version 1 --num-layers 8 --num-filters 4 --image-size 32 --batch-size 4 "
         "--num-samples 16 --num-classes 3 --dtype float64 --steps 4 --split-size 2 --spatial-size 1 "
         "--num-spatial-parts 4 --balance 2,2 --optimizer adamw --lr 0.01 --lr-schedule cosine --warmup-steps 2 "
         "--augment flip,rot90 --class-weights 1,2,3 --val-fraction 0.25 --eval-every 2 --keep-best val_loss "
         "--checkpoint-dir ckpt --resume latest --allow-config-change lr --on-nonfinite skip-step --no-progress "
         "--step-timeout 0").split()
KEYWORDS: dict[str, object] = dict(
    model="resnet", resnet_version=1, num_layers=8, num_filters=4, image_size=32, batch_size=4, num_samples=16,
    num_classes=3, dtype="float64", steps=4, split_size=2, spatial_size=1, num_spatial_parts=4, balance=(2, 2),
    optimizer="adamw", lr=0.01, lr_schedule="cosine", warmup_steps=2, augment="flip,rot90", class_weights="1,2,3",
    val_fraction=0.25, eval_every=2, keep_best="val_loss", checkpoint_dir=Path("ckpt"), resume="latest",
    allow_config_change="lr", on_nonfinite="skip-step", progress=False, step_timeout=0)


def flags_job(argv: list[str]) -> TrainJob:
    """The job ``train`` builds from ``argv`` (parsed, checked, laid out for the 5 ranks it asks for)."""
    args, cfg = parse_launch(cli.build_parser(), argv, cli.check_run_args)
    return train_job(args, cfg)


def test_the_same_job_and_record_from_flags_and_from_keywords(monkeypatch):
    monkeypatch.setattr("mpi4dl_nb.cli.layout_cmd.launched_world", lambda: (0, 5, True))
    from_flags = flags_job(FLAGS)
    from_keywords = job_from_keywords(**KEYWORDS)
    assert from_flags == from_keywords
    assert from_flags.record() == from_keywords.record()
    assert from_flags.training.class_weights == (1.0, 2.0, 3.0) and from_flags.data.class_names == ("0", "1", "2")
    assert from_flags.config.balance == (2, 2) and from_flags.checkpoints.allow_config_change == {"lr"}
    assert job_from_keywords(**{**KEYWORDS, "lr": 0.02}) != from_flags      # a keyword is not ignored


def test_keywords_are_checked_like_flags():
    with pytest.raises(ConfigError, match="num_layer: is not a setting of train; did you mean num_layers"):
        job_from_keywords(num_layer=8)
    with pytest.raises(ConfigError, match="optimizer: 'adam': choose one of sgd, adamw"):
        job_from_keywords(optimizer="adam")
    with pytest.raises(ConfigError, match="--val-fraction"):
        job_from_keywords(val_fraction=1.5)


def test_no_namespace_after_the_builder():
    """No ``getattr(args, ...)`` in the package; no function outside cli/ takes an argparse Namespace."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        assert "getattr(args" not in text, path
        if path.parent.name == "cli":
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                if any(a.annotation is not None and "Namespace" in ast.unparse(a.annotation) for a in arguments):
                    offenders.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert not offenders
    assert not any(isinstance(value, argparse.Namespace) for value in vars(job_from_keywords()).values())


def test_one_agreed_and_evaluate_independent_of_train():
    from mpi4dl_nb.cli import evaluate_cmd as evaluate_module

    named = [f"{p.relative_to(PACKAGE)}" for p in PACKAGE.rglob("*.py")
             if any(isinstance(n, ast.FunctionDef) and n.name == "agreed" for n in ast.walk(ast.parse(p.read_text())))]
    assert "comm/agreement.py" in named and "cli/train_cmd.py" not in named, named
    imported = [n.module for n in ast.walk(ast.parse(Path(evaluate_module.__file__).read_text()))
                if isinstance(n, ast.ImportFrom)]
    assert not any(module and module.endswith("train_cmd") for module in imported), imported


def test_class_weighted_val_loss_is_the_same_from_training_and_from_evaluate(tmp_path, capsys):
    """One process, float64: the last evaluation of a run trained with --class-weights and ``evaluate`` of its
    final checkpoint report the same val_loss (1e-12), both named as the weighted cross-entropy."""
    write_tiles(tmp_path / "tiles", per_class=6, size=32)
    data = ["--app", "medical", "--datapath", str(tmp_path / "tiles"), "--num-classes", "2"]
    model = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4",
             "--image-size", "32", "--dtype", "float64", "--split-size", "1", "--spatial-size", "0"]
    assert cli.main([*model, *data, "--batch-size", "4", "--steps", "2", "--val-fraction", "0.35",
                     "--class-weights", "0.5,3", "--checkpoint-dir", str(tmp_path / "ckpt"), "--no-progress"]) == 0
    trained = json_record(capsys.readouterr().out)
    assert evaluate_cmd.main(["--checkpoint", str(tmp_path / "ckpt"), "--split-size", "1", "--spatial-size", "0",
                              *data]) == 0
    evaluated = json_record(capsys.readouterr().out, '{"checkpoint"')
    assert evaluated["step"] == trained["val_step"] == 2 and evaluated["count"] == trained["val_count"]
    assert abs(evaluated["loss"] - trained["val_loss"]) <= 1e-12 * max(1.0, abs(trained["val_loss"]))
    assert trained["val_loss_of"] == evaluated["loss_of"] == "cross-entropy, class weights 0.5,3"


def test_a_job_is_frozen_and_grows_by_fields():
    job = job_from_keywords()
    with pytest.raises(AttributeError):
        job.data = replace(job.data)   # type: ignore[misc]
    assert replace(job, training=replace(job.training, seed=1)).training.seed == 1
