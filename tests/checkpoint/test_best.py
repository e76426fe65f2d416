"""The best checkpoint: kept apart from rotation, named as such, chosen by --checkpoint-select; the run record's
training settings, best mark and class names read back."""
from __future__ import annotations

import json
import time

import pytest
import torch

from mpi4dl_nb.checkpoint import files as ck
from mpi4dl_nb.checkpoint.files import BestMark, CheckpointSelect, best_checkpoint, select_checkpoint
from mpi4dl_nb.checkpoint.record import DataRecord, RunRecord, TrainingRecord, read_checkpoint, write_checkpoint
from mpi4dl_nb.data.augment import AugmentSpec
from mpi4dl_nb.models.spec import ModelSpec
from mpi4dl_nb.pipeline.optim import LRSchedule, LRScheduleKind, OptimizerSpec

STATE = {"0.weight": torch.ones(2, dtype=torch.float64)}


def record(run_id: str = "aaaaaaaaaaaa", step: int = 1, best: BestMark | None = None) -> RunRecord:
    spec = ModelSpec.of("resnet", num_layers=8, num_filters=4, num_classes=2, resnet_version=1)
    training = TrainingRecord(OptimizerSpec.of("adamw", 0.001), LRSchedule(LRScheduleKind.COSINE, 10, 2),
                              AugmentSpec.parse("flip,hed"), (0.5, 1.5))
    data = DataRecord("medical", 32, 4, "float64", "/data", 0.25, None, ("benign", "tumour"))
    return RunRecord(spec, data, seed=3, training=training, best=best).at(step, run_id)


def save(folder, step, run_id="aaaaaaaaaaaa", best=None, keep=1):
    return write_checkpoint(folder, record(run_id, step, best), STATE, None, keep=keep, best=best is not None)


def test_best_is_kept_apart_from_rotation_and_replaced_by_a_better_one(tmp_path):
    first_best = save(tmp_path, 1, best=BestMark("val_loss", 0.5, 1))
    for step in (1, 2, 3):
        save(tmp_path, step)
    assert [e.step for e in ck.list_checkpoints(tmp_path)] == [3]                 # keep 1 rotates
    assert first_best.name == "best-step-00000001-aaaaaaaaaaaa.pt" and first_best.exists()
    manifest = json.loads(first_best.with_suffix(".json").read_text())
    assert manifest["best"] == {"metric": "val_loss", "value": 0.5, "step": 1}
    assert ck.latest_checkpoint(tmp_path).name == "step-00000003-aaaaaaaaaaaa.pt"  # latest ignores the best
    other_run = save(tmp_path, 2, run_id="bbbbbbbbbbbb", best=BestMark("val_loss", 0.7, 2))
    better = save(tmp_path, 3, best=BestMark("val_loss", 0.4, 3))
    assert not first_best.exists() and not first_best.with_suffix(".json").exists()   # superseded
    assert other_run.exists() and better.exists()                                      # another run's stays
    assert save(tmp_path, 3, best=BestMark("val_loss", 0.4, 3)) == better              # a redone step: kept


def test_selection_latest_best_file_and_missing(tmp_path):
    save(tmp_path, 1, best=BestMark("val_loss", 0.9, 1))
    newest = save(tmp_path, 2)
    assert select_checkpoint(tmp_path) == newest
    assert select_checkpoint(tmp_path, "best").name.startswith("best-step-00000001")
    assert select_checkpoint(newest, CheckpointSelect.LATEST) == newest
    with pytest.raises(ValueError, match="best checkpoint of a directory.*give its directory"):
        select_checkpoint(newest, "best")
    with pytest.raises(FileNotFoundError, match="no such checkpoint file or directory"):
        select_checkpoint(tmp_path / "gone")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no checkpoint step-"):
        select_checkpoint(empty)
    with pytest.raises(FileNotFoundError, match="no best checkpoint.*--keep-best METRIC"):
        select_checkpoint(empty, "best")


def test_the_best_of_several_runs_by_value_or_the_newest_across_metrics(tmp_path):
    save(tmp_path, 5, "aaaaaaaaaaaa", BestMark("val_roc_auc", 0.91, 5))
    time.sleep(0.01)
    save(tmp_path, 3, "bbbbbbbbbbbb", BestMark("val_roc_auc", 0.80, 3))
    assert best_checkpoint(tmp_path).run_id == "aaaaaaaaaaaa"       # higher AUC is better, though older
    time.sleep(0.01)
    save(tmp_path, 2, "cccccccccccc", BestMark("val_loss", 0.3, 2))
    assert best_checkpoint(tmp_path).run_id == "cccccccccccc"       # metrics differ: the newest


def test_the_record_reads_back_its_training_best_and_class_names(tmp_path):
    path = save(tmp_path, 4, best=BestMark("val_accuracy", 0.75, 4))
    back = read_checkpoint(path).record
    assert back.training == record().training and back.best == BestMark("val_accuracy", 0.75, 4)
    assert back.class_names == ("benign", "tumour") and back.data.classes == ("benign", "tumour")
    assert back.summary_fields()["classes"] == ["benign", "tumour"]
    older = RunRecord(record().model, DataRecord("synthetic", 32, 4))                   # written before names
    assert older.class_names == ("0", "1") and older.training is None and older.best is None
    payload = older.at(1, "dddddddddddd").to_payload()
    payload["record"].pop("training")
    payload["record"].pop("best")
    payload["record"]["data"].pop("classes")
    assert RunRecord.from_payload(payload, "old.pt").class_names == ("0", "1")
    with pytest.raises(ValueError, match="best mark"):
        write_checkpoint(tmp_path, record(), STATE, None, best=True)
