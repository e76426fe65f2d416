"""``train --config`` end to end on one process (issue 65): a run from a file equals the run from the same flags, and
the ``config.toml`` a run writes beside its checkpoints runs it again (the same losses, float64)."""
from __future__ import annotations

from tests.support.summary import json_record
from tests.support.train_in_process import run_train

FLAGS = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4", "--image-size", "16",
         "--batch-size", "4", "--num-samples", "8", "--num-classes", "2", "--steps", "2", "--lr", "0.05",
         "--optimizer", "adamw", "--augment", "flip", "--no-progress", "--split-size", "1", "--spatial-size", "0",
         "--dtype", "float64"]
FILE = """# the same run as FLAGS: top-level keys (dashes or underscores) and the train table
num_layers = 8
num-filters = 4
image-size = 16
batch-size = 4
dtype = "float64"
memory-limit-mb = 100      # tune's: left to it

[train]
model = "resnet"
resnet-version = 1
num-samples = 8
num-classes = 2
steps = 2
lr = 0.05
optimizer = "adamw"
augment = ["flip"]
no-progress = true
split-size = 1
spatial_size = 0
"""
VARYING = ("run_id", "wall_seconds", "images_per_s", "compute_seconds", "comm_seconds", "input_wait_seconds",
           "train_seconds", "checkpoint", "peak_memory_bytes", "activation_peak_bytes")


def steady(summary: dict) -> dict:
    """A summary less what differs between two runs of one job: its run id, timings and files."""
    return {key: value for key, value in summary.items() if key not in VARYING}


def test_a_file_runs_as_its_flags_and_the_written_config_runs_it_again(tmp_path, capsys):
    first = tmp_path / "first"
    code, out, err = run_train([*FLAGS, "--checkpoint-dir", str(first)], capsys)
    assert code == 0, err
    by_flags = json_record(out)
    written = first / "config.toml"
    assert "[train]" in written.read_text() and "lr = 0.05" in written.read_text()

    job = tmp_path / "job.toml"
    job.write_text(FILE)
    code, out, err = run_train(["--config", str(job), "--checkpoint-dir", str(first)], capsys)
    assert code == 0, err
    by_file = json_record(out)
    assert steady(by_file) == steady(by_flags) and by_file["run_id"] != by_flags["run_id"]
    assert sorted(p.name for p in first.glob("config*.toml")) == ["config.toml"]   # the same flags: one file

    again = tmp_path / "again"
    code, out, err = run_train(["--config", str(written), "--checkpoint-dir", str(again)], capsys)
    assert code == 0, err
    rerun = json_record(out)
    assert rerun["losses"] == by_flags["losses"] and steady(rerun) == steady(by_flags)
    differ = [a for a, b in zip(written.read_text().splitlines(), (again / "config.toml").read_text().splitlines())
              if a != b]
    assert differ == [f'checkpoint-dir = "{first}"']
