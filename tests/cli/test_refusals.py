"""What a new user hit (issue 51), each said as it is, before any work (one process, no rank started): an unwritable
``--slide-csv``, ``--cohort`` with ``--datapath``, ``--whole-slide --task segmentation``, a bad flag value (one line,
not the usage of every flag, on every command), and a JSON summary that echoes the layout as it ran."""
from __future__ import annotations

import time

import pytest

from mpi4dl_nb.cli import evaluate_cmd, infer_cmd, layout_cmd, train_cmd, tune_cmd
from mpi4dl_nb.config import ParallelConfig
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.run.evaluate_job import EvaluateJob
from mpi4dl_nb.run.job import TrainJob
from mpi4dl_nb.run.summary import config_as_run
from tests.support.train_in_process import run_command


@pytest.mark.parametrize("where", ["/proc/slides.csv", "{tmp}", "{tmp}/missing/slides.csv"])
def test_an_unwritable_slide_csv_is_refused_before_any_work(tmp_path, capsys, where):
    """Was: evaluated every slide, then failed writing the table (``/proc`` passes an access check as root; a
    folder passes the parent's)."""
    path = where.format(tmp=tmp_path)
    with pytest.raises(ConfigError, match="--slide-csv") as refused:
        EvaluateJob.of(checkpoint=str(tmp_path / "none"), slide_csv=path).check()
    assert "choose" in str(refused.value) or "name a file" in str(refused.value)
    start = time.monotonic()
    code, out, err = run_command(evaluate_cmd.main, ["--checkpoint", str(tmp_path / "none"), "--slide-csv", path,
                                                     "--split-size", "1", "--spatial-size", "0"], capsys)
    assert code == 2 and not out and "--slide-csv" in err and "checkpoint" not in err.split("--slide-csv")[0], err
    assert time.monotonic() - start < 10 and not list(tmp_path.glob(".mpi4dl-write-check-*"))


def test_a_writable_slide_csv_is_left_as_it_was(tmp_path):
    table = tmp_path / "slides.csv"
    table.write_text("kept\n")
    with pytest.raises(ConfigError, match="--checkpoint"):           # past the table: the checkpoint is missing
        EvaluateJob.of(checkpoint=str(tmp_path / "none"), slide_csv=str(table)).check()
    assert table.read_text() == "kept\n" and sorted(p.name for p in tmp_path.iterdir()) == ["slides.csv"]


def test_cohort_with_datapath_names_the_conflict(capsys, tmp_path):
    """Was: ``--datapath: --app synthetic does not read --datapath`` (the cohort implies --app medical)."""
    code, _, err = run_command(train_cmd.main, ["--cohort", str(tmp_path / "c.csv"), "--datapath", str(tmp_path),
                                                "--split-size", "1", "--spatial-size", "0"], capsys)
    assert code == 2 and "--cohort: gives the slides; drop --datapath" in err and "synthetic" not in err, err


def test_whole_slide_segmentation_is_said_to_be_unsupported(capsys, tmp_path):
    """Was: a request for per-pixel labels (a mask folder), as if the combination could work."""
    for model in (["--model", "unet"], []):
        code, _, err = run_command(train_cmd.main, ["--whole-slide", "--task", "segmentation", *model, "--datapath",
                                                    str(tmp_path), "--split-size", "1", "--spatial-size", "0"], capsys)
        assert code == 2 and "--whole-slide: with --task segmentation is not supported" in err, err
        assert "masks" not in err.split("not supported")[0] and "per-pixel labels" not in err


COMMANDS = {"train": (train_cmd.main, ["--slice-method", "2x2"]),
            "evaluate": (evaluate_cmd.main, ["--checkpoint", "x", "--slice-method", "2x2"]),
            "layout": (layout_cmd.main, ["--slice-method", "2x2"]),
            "tune": (tune_cmd.main, ["--memory-limit-mb", "100", "--image-size", "big"]),
            "infer": (infer_cmd.main, ["--checkpoint", "x", "--slide", "s.tif", "--output", "o.npy",
                                       "--slice-method", "2x2"])}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_bad_flag_value_is_one_line_and_where_the_flags_are(capsys, name):
    """Was: ~70 lines of usage before the one line that matters."""
    main, argv = COMMANDS[name]
    code, out, err = run_command(main, argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and not out and len(lines) == 2 and "usage:" not in err, err
    assert lines[0].startswith(f"python -m mpi4dl_nb {name}: error: argument --")
    assert lines[1] == f"'python -m mpi4dl_nb {name} --help' lists every flag."


def test_the_summary_echoes_the_layout_as_it_ran():
    """Was: ``slice_method "square"`` and 4 parts in a one-process run, ``square`` beside a 1x2x2 volume grid."""
    one = config_as_run(ParallelConfig(split_size=1, spatial_size=0).as_dict())
    assert one["slice_method"] is None and one["num_spatial_parts"] == 1 and one["split_size"] == 1
    volume = config_as_run(ParallelConfig(split_size=1, spatial_size=1, slice_method="1x2x2").as_dict())
    assert volume["slice_method"] == "1x2x2" and volume["num_spatial_parts"] == 4 and volume["volume_grid"] == [1, 2, 2]
    grid = config_as_run(ParallelConfig(spatial_size=1, num_spatial_parts=2, grid=(2, 1)).as_dict())
    assert grid["slice_method"] is None and grid["grid"] == [2, 1]
    image = ParallelConfig(num_spatial_parts=2, slice_method="vertical").as_dict()
    assert config_as_run(image) == image                               # a tiled image run: as given


@pytest.mark.parametrize(("model", "found"), [
    ("resnet", "--model resnet has none"),
    ("timm:swin_tiny_patch4_window7_224", "--model timm:swin_tiny_patch4_window7_224 is a SwinTransformer"),
])
def test_layer_decay_without_vit_blocks_is_refused_with_the_flags(capsys, model, found):
    """Checked with the flags (``run/flag_checks.py``), before the model is built or any data read."""
    if model.startswith("timm:"):
        from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

        require_or_skip(missing_modules("timm"), "timm's Swin", MODELS_EXTRA)
    with pytest.raises(ConfigError, match="--layer-decay: decays a vision transformer's rates block by block"):
        TrainJob.of(model=model, layer_decay=0.75)
    flags = ["--model", model, "--layer-decay", "0.75", "--split-size", "1", "--spatial-size", "0", "--app",
             "medical", "--datapath", "/nonexistent"]
    code, out, err = run_command(train_cmd.main, flags, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and not out and len(lines) == 1 and found in err and "drop --layer-decay" in err, err
