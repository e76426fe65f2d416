"""train's fine-tuning flags, class names and the best checkpoint from the command line (one process), and the
small fixes: "did you mean", help without switch defaults, a missing checkpoint named first, tune's train line."""
from __future__ import annotations

import shlex

import pytest

import mpi4dl_nb.cli.layout_cmd as cli_layout
from mpi4dl_nb.checkpoint import files as ck
from mpi4dl_nb.cli import evaluate_cmd, infer_cmd, layout_cmd, tune_cmd
from mpi4dl_nb.cli import train_cmd as cli
from mpi4dl_nb.cli.args import config_from_args
from mpi4dl_nb.config import ParallelConfig
from mpi4dl_nb.evaluation.log import read_metrics
from mpi4dl_nb.notebook.curves import plot_learning_curves
from tests.support.bad_data import write_tiles
from tests.support.summary import json_record

MODEL = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4",
         "--batch-size", "4", "--no-progress", "--split-size", "1", "--spatial-size", "0", "--dtype", "float64"]
COMMANDS = {"train": cli.main, "evaluate": evaluate_cmd.main, "infer": infer_cmd.main, "tune": tune_cmd.main,
            "layout": layout_cmd.main}


def run(main, capsys, argv: list[str]) -> tuple[int, str, str]:
    """A command in this process (one rank): exit code, stdout, stderr."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_keep_best_outlives_rotation_and_evaluate_selects_it(capsys, tmp_path):
    """Acceptance: --keep-best val_loss with --keep-checkpoints 1 keeps the best checkpoint after later ones are
    worse; evaluate --checkpoint DIR --checkpoint-select best loads it (its loss is the recorded value)."""
    folder, log = tmp_path / "ck", tmp_path / "log"
    code, out, err = run(cli.main, capsys, [
        *MODEL, "--image-size", "16", "--num-samples", "24", "--num-classes", "2", "--steps", "4",
        "--optimizer", "adamw", "--lr", "0.3", "--val-fraction", "0.25", "--eval-every", "1",
        "--keep-best", "val_loss", "--checkpoint-every", "1", "--keep-checkpoints", "1",
        "--checkpoint-dir", str(folder), "--log-dir", str(log)])
    assert code == 0, err
    losses = {r["step"]: r["val_loss"] for r in read_metrics(log) if r["kind"] == "eval"}
    best_step = min(losses, key=losses.__getitem__)
    assert best_step < 4 and losses[4] > losses[best_step], losses      # the later checkpoints are worse
    assert [e.step for e in ck.list_checkpoints(folder)] == [4]          # rotation kept only the newest ...
    (best,) = ck.list_checkpoints(folder, best=True)                     # ... and the best stayed apart
    assert best.step == best_step and best.path.name.startswith("best-step-")
    assert best.best == ck.BestMark("val_loss", losses[best_step], best_step)
    summary = json_record(out)
    assert summary["best"] == {"metric": "val_loss", "value": losses[best_step], "step": best_step}
    assert summary["best_checkpoint"] == str(best.path) and "(the best val_loss so far: kept)" in err
    marked = [r for r in read_metrics(log) if r["kind"] == "eval" and "best" in r]
    assert marked[-1]["step"] == best_step                                # the log says which one was kept
    stars = [line for ax in plot_learning_curves(log).axes for line in ax.lines if line.get_marker() == "*"]
    assert [(list(s.get_xdata()), list(s.get_ydata())) for s in stars] == [([best_step], [losses[best_step]])]
    code, out, err = run(evaluate_cmd.main, capsys, ["--checkpoint", str(folder), "--checkpoint-select", "best",
                                                     "--split-size", "1", "--spatial-size", "0", "--num-samples", "24"])
    assert code == 0, err
    chosen = json_record(out, '{"checkpoint"')
    assert chosen["checkpoint"] == str(best.path) and chosen["step"] == best_step
    assert chosen["checkpoint_select"] == "best" and chosen["best"]["value"] == losses[best_step]
    assert chosen["loss"] == pytest.approx(losses[best_step], rel=1e-12, abs=0)
    latest = json_record(run(evaluate_cmd.main, capsys, ["--checkpoint", str(folder), "--split-size", "1",
                                                         "--spatial-size", "0", "--num-samples", "24"])[1],
                         '{"checkpoint"')
    assert latest["step"] == 4 and latest["loss"] == pytest.approx(losses[4], rel=1e-12, abs=0)


def test_class_folders_set_the_classes_and_a_disagreeing_count_is_refused_first(capsys, tmp_path):
    """Acceptance: --num-classes 3 on two class folders stops before the first step; names reach the outputs."""
    write_tiles(tmp_path / "tiles", per_class=4, classes=("tumour", "benign"), size=32)
    data = [*MODEL, "--image-size", "32", "--app", "medical", "--datapath", str(tmp_path / "tiles"), "--steps", "1"]
    code, out, err = run(cli.main, capsys, [*data, "--num-classes", "3"])
    assert code == 2 and not out and "step 1" not in err
    assert "--num-classes: " in err and "has 2 classes (benign, tumour), not 3; use --num-classes 2" in err
    folder = tmp_path / "ck"
    code, out, err = run(cli.main, capsys, [*data, "--classes", "tumour,benign", "--val-fraction", "0.25",
                                            "--checkpoint-dir", str(folder)])
    assert code == 0, err
    summary = json_record(out)
    assert summary["num_classes"] == 2 and summary["classes"] == ["tumour", "benign"]
    assert set(summary["val_recall_by_class"]) == {"tumour", "benign"}
    record = ck.load_checkpoint(ck.latest_checkpoint(folder))["record"]
    assert record["data"]["classes"] == ["tumour", "benign"]
    evaluated = json_record(run(evaluate_cmd.main, capsys, ["--checkpoint", str(folder), "--split-size", "1",
                                                            "--spatial-size", "0", "--datapath",
                                                            str(tmp_path / "tiles")])[1], '{"checkpoint"')
    assert evaluated["classes"] == ["tumour", "benign"] and evaluated["count"] == summary["val_count"]
    code, _, err = run(cli.main, capsys, [*data, "--classes", "tumour,normal"])
    assert code == 2 and "--classes" in err and "benign" in err


@pytest.mark.parametrize("argv,says", [
    (["--optimizer", "adamw", "--momentum", "0.9"], "--momentum: applies to --optimizer sgd"),
    (["--warmup-steps", "3"], "--warmup-steps: must be >= 0 and below the run's 3 steps"),
    (["--lr-schedule", "step", "--lr-gamma", "0"], "--lr-gamma: must be a number > 0"),
    (["--weight-decay", "-1"], "--weight-decay: must be a number >= 0"),
    (["--class-weights", "1,2,3"], "--class-weights: gives 3 weights for 2 classes (0, 1)"),
    (["--augment", "flip,blur"], "--augment: unknown augmentation blur"),
    (["--classes", "a,b,c"], "--classes: names 3 classes but --num-classes is 2"),
    (["--keep-best", "val_loss", "--val-fraction", "0.25"], "--keep-best: keeps the best checkpoint in "
                                                            "--checkpoint-dir"),
    (["--keep-best", "val_loss", "--checkpoint-dir", "/tmp/x"], "--keep-best: measures checkpoints on "
                                                                 "validation data"),
])
def test_bad_fine_tuning_flags_are_refused_before_any_rank_talks(capsys, argv, says):
    code, out, err = run(cli.main, capsys, [*MODEL, "--image-size", "16", "--num-classes", "2", "--steps", "3",
                                            *argv])
    said = err.replace("error: argument --", "configuration error: --")      # a bad flag value: a usage error
    assert code == 2 and not out and f"configuration error: {says}" in said and len(err.splitlines()) <= 2, err


def test_roc_auc_needs_two_classes(capsys):
    code, _, err = run(cli.main, capsys, [*MODEL, "--num-classes", "1", "--keep-best", "val_roc_auc",
                                          "--val-fraction", "0.5", "--checkpoint-dir", "/tmp/x"])
    assert code == 2 and "val_roc_auc ranks one class against the others: it needs 2 or more classes" in err, err


MISSPELT = {"train": ("--batch-sise", "--batch-size"), "evaluate": ("--checkpont", "--checkpoint"),
            "infer": ("--slide-levle", "--slide-level"), "tune": ("--memory-limit-mv", "--memory-limit-mb"),
            "layout": ("--split-sise", "--split-size")}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_misspelt_flag_gets_the_closest_names_on_every_command(capsys, name):
    """Also when the misspelling leaves a required flag missing (evaluate's --checkpoint, tune's limit)."""
    wrong, right = MISSPELT[name]
    code, _, err = run(COMMANDS[name], capsys, [wrong, "4"])
    assert code == 2 and f"{wrong}: did you mean {right}" in err, err


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_shows_defaults_of_values_not_of_switches(capsys, name):
    code, out, _ = run(COMMANDS[name], capsys, ["--help"])
    assert code == 0 and "(default: True)" not in out and "(default: False)" not in out
    assert "(default: None)" not in out and "(default: " in out


def test_a_missing_checkpoint_is_named_before_a_wrong_rank_count(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli_layout, "launched_world", lambda: (0, 3, True))
    missing = str(tmp_path / "nothing")
    code, _, err = run(evaluate_cmd.main, capsys, ["--checkpoint", missing])        # 5 ranks wanted, 3 launched
    assert code == 2 and "--checkpoint: " in err and "no such checkpoint" in err and "ranks" not in err
    code, _, err = run(infer_cmd.main, capsys, ["--checkpoint", missing, "--slide", "s.tif", "--output", "o.npy",
                                                "--num-spatial-parts", "4"])
    assert code == 2 and "--checkpoint: " in err and "no such checkpoint" in err and "ranks" not in err
    code, _, err = run(cli.main, capsys, ["--resume", missing])
    assert code == 2 and "--resume: " in err and "ranks" not in err
    (tmp_path / "empty").mkdir()
    code, _, err = run(evaluate_cmd.main, capsys, ["--checkpoint", str(tmp_path / "empty"),
                                                   "--checkpoint-select", "best"])
    assert code == 2 and "no best checkpoint" in err and "--keep-best" in err


@pytest.mark.parametrize("cfg", [ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4),
                                 ParallelConfig(split_size=3, spatial_size=0, parts=2, schedule="1f1b",
                                                balance=(2, 2, 1), local_dp=2),
                                 ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=2, grid=(2, 1),
                                                halo_d2=True, fused_layers=2)])
def test_tune_prints_a_train_command_that_gives_its_pick(cfg):
    job = tune_cmd.tune_job(tune_cmd.tune_parser().parse_args(["--memory-limit-mb", "100", "--num-layers", "11",
                                                               "--dtype", "float64"]))
    line = shlex.split(tune_cmd.train_command(job, cfg))
    assert line[:3] == ["mpiexec", "-n", str(cfg.world_size)]
    parsed = cli.train_parser().parse_args(line[line.index("train") + 1:])
    assert (parsed.num_layers, parsed.dtype, parsed.num_classes, parsed.image_size) == (11, "float64", 2, 128)
    back = config_from_args(parsed)
    assert back.grid_shape == cfg.grid_shape
    layout_only = ("grid", "slice_method")
    assert {k: v for k, v in back.as_dict().items() if k not in layout_only} == \
        {k: v for k, v in cfg.as_dict().items() if k not in layout_only}
