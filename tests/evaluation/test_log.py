"""metrics.jsonl: one line per record, flushed; a resume drops the redone steps; a fresh run keeps the old file."""
from __future__ import annotations

import json

import pytest

from mpi4dl_nb.evaluation.log import LOG_NAME, MetricsLog, read_metrics


def test_lines_flushed_resume_without_duplicates_fresh_run_moves_old_aside(tmp_path):
    log = MetricsLog(tmp_path, "run1", tensorboard=False)
    for step in range(1, 6):
        log.write("train", step, {"loss": float("nan") if step == 2 else 1.0 / step})
        assert len(read_metrics(tmp_path)) == step                  # flushed at once
    log.write("eval", 4, {"val_loss": 0.5})
    log.close()
    with open(tmp_path / LOG_NAME, "a") as torn:
        torn.write('{"kind": "train", "st')                          # a crash mid-line
    records = read_metrics(tmp_path / LOG_NAME)
    assert records[1]["loss"] is None and records[-1] == {"kind": "eval", "step": 4, "run_id": "run1",
                                                          "val_loss": 0.5}
    # resumed from the step-3 checkpoint: steps 4-5 (and the eval at 4) are redone, not duplicated
    log = MetricsLog(tmp_path, "run1", start_step=3, tensorboard=False)
    for step in (4, 5):
        log.write("train", step, {"loss": 0.1})
    log.close()
    steps = [(r["kind"], r["step"]) for r in read_metrics(tmp_path)]
    assert steps == [("train", s) for s in range(1, 6)]
    assert all(json.loads(line) for line in (tmp_path / LOG_NAME).read_text().splitlines())
    # a fresh run in the same directory: the old file is kept under the old run's name
    log = MetricsLog(tmp_path, "run2", tensorboard=False)
    log.close()
    assert log.moved_aside == tmp_path / "metrics-run1.jsonl" and len(read_metrics(log.moved_aside)) == 5
    assert read_metrics(tmp_path) == []


def test_no_tensorboard_no_event_file_and_no_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def without_tensorboard(name, *args, **kwargs):
        if name.split(".")[0] == "tensorboard" or name.startswith("torch.utils.tensorboard"):
            raise ImportError(f"no module named {name!r} (hidden by the test)")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_tensorboard)
    log = MetricsLog(tmp_path, "run1")
    log.write("train", 1, {"loss": 0.7})
    log.close()
    assert [p.name for p in tmp_path.iterdir()] == [LOG_NAME]
    assert len(read_metrics(tmp_path)) == 1


def test_tensorboard_events_beside_the_log_when_installed(tmp_path):
    pytest.importorskip("tensorboard")   # optional extra `[tensorboard]`; the test above covers its absence
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path, "run1")
    log.write("train", 1, {"loss": 0.7})
    log.write("eval", 1, {"val_loss": 0.6, "val_accuracy": 0.5})
    log.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "eval/loss", "eval/accuracy"}
    assert [e.value for e in events.Scalars("eval/accuracy")] == [0.5]
