"""Issue 91 item 7: ``--early-stop N`` stops a run whose ``--keep-best`` metric has not improved for N evaluations,
its best checkpoint kept; ``--balanced-sampler`` draws each class equally (a 1:9 folder: half and half), within a
class each slide in turn, the same batches for the same seed (every rank, a resume) and from ``dl.train`` too."""
from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import mpi4dl_nb as dl
from mpi4dl_nb.checkpoint.files import list_checkpoints, select_checkpoint
from mpi4dl_nb.checkpoint.record import read_checkpoint
from mpi4dl_nb.data import Batcher
from mpi4dl_nb.data.balanced import BalancedOrder
from mpi4dl_nb.data.pathology import TileFolderDataset
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.evaluation import evaluator
from mpi4dl_nb.run.job import TrainJob
from tests.support.train_in_process import run_train

SMALL = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4", "--image-size", "16",
         "--split-size", "1", "--spatial-size", "0", "--no-progress", "--dtype", "float64"]


def folder(root: Path, counts: dict[str, int], slides: int = 1) -> Path:
    """Class folders of 16 px tiles named ``<slide>_<x>_<y>`` (``slides`` slides per class, tiles dealt in turn)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for name, count in counts.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(
                root / name / f"{name}{i % slides}_{i}_0.png")
    return root


def test_early_stop_ends_a_run_whose_metric_stopped_improving_keeping_its_best(tmp_path, capsys, monkeypatch):
    """val_loss 0.9, 0.5, 0.6, 0.7 at steps 1-4: with --early-stop 2 the run stops at step 4 (two evaluations past the
    best, of step 2), not at --steps 8; the best checkpoint is step 2's, and a final one holds step 4."""
    scripted = iter([0.9, 0.5, 0.6, 0.7, 0.4, 0.3, 0.2, 0.1])
    run = evaluator.Evaluator.run
    monkeypatch.setattr(evaluator.Evaluator, "run", lambda self: dataclasses.replace(run(self), loss=next(scripted)))
    data = folder(tmp_path / "tiles", {"a": 8, "b": 8}, slides=4)
    ck = tmp_path / "ck"
    code, out, err = run_train([*SMALL, "--app", "medical", "--datapath", str(data), "--batch-size", "2", "--steps",
                                "8", "--val-fraction", "0.25", "--eval-every", "1", "--keep-best", "val_loss",
                                "--early-stop", "2", "--checkpoint-dir", str(ck)], capsys)
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["early_stopped"] == 4 and summary["best"]["step"] == 2, summary
    best = select_checkpoint(ck, "best")
    assert read_checkpoint(best).record.step == 2 and summary["best_checkpoint"] == str(best)
    assert [e.step for e in list_checkpoints(ck)][-1] == 4
    said = [line for line in err.splitlines() if line.startswith("early stop")]
    assert said == [f"early stop at step 4: val_loss has not improved for 2 evaluations (--early-stop 2); the best, "
                    f"0.5 at step 2, is kept: {best}"], err


def test_early_stop_needs_keep_best():
    with pytest.raises(ConfigError, match="--early-stop: counts evaluations without a better --keep-best metric"):
        TrainJob.of(early_stop=2, checkpoint_dir="ck", val_fraction=0.25)


def test_the_balanced_sampler_draws_each_class_equally_from_a_one_to_nine_folder(tmp_path):
    data = TileFolderDataset(folder(tmp_path / "tiles", {"rare": 4, "common": 36}, slides=2), 16)
    labels = tuple(data.label(i) for i in range(len(data)))
    order = BalancedOrder(labels, tuple(p.stem.split("_")[0] for p in data.files))
    batcher = Batcher(data, 4, seed=3, balanced=order)
    for epoch in range(3):
        drawn = [i for step in range(batcher.steps_per_epoch) for i in batcher.indices(epoch, step)]
        assert Counter(labels[i] for i in drawn) == {0: 20, 1: 20}              # 1:9 in the folder, 1:1 drawn
        for step in range(batcher.steps_per_epoch):                                # each batch of 4: 2 and 2
            assert sorted(labels[i] for i in batcher.indices(epoch, step)) == [0, 0, 1, 1]
        rare = [data.files[i].stem.split("_")[0] for i in drawn if labels[i] == 1]
        assert Counter(rare) == {"rare0": 10, "rare1": 10}                       # its two slides in turn
        common = Counter(data.files[i].stem.split("_")[0] for i in drawn if labels[i] == 0)
        assert common == {"common0": 10, "common1": 10}
    again = Batcher(data, 4, seed=3, balanced=BalancedOrder(labels, order.groups))     # another rank, a resume
    assert [again.indices(1, s) for s in range(10)] == [batcher.indices(1, s) for s in range(10)]
    assert batcher.indices(0, 0) != batcher.indices(1, 0) or batcher.indices(0, 1) != batcher.indices(1, 1)


def test_balanced_sampler_from_the_command_line_and_python(tmp_path, capsys, monkeypatch):
    """``--balanced-sampler`` and ``dl.train(balanced_sampler=True)`` build the same job; a run's batches are drawn
    class by class (the labels the engine trains on, half and half), its identity names the sampler."""
    data = folder(tmp_path / "tiles", {"rare": 2, "common": 18})
    job = TrainJob.of(balanced_sampler=True, early_stop=1, keep_best="val_loss", checkpoint_dir="ck",
                      val_fraction=0.25)
    assert job.training.balanced_sampler and job.checkpoints.early_stop == 1
    seen: list[int] = []
    labels = Batcher.labels
    monkeypatch.setattr(Batcher, "labels", lambda self, e, s: (found := labels(self, e, s), seen.extend(
        found.tolist()))[0])
    code, _, err = run_train([*SMALL, "--app", "medical", "--datapath", str(data), "--batch-size", "2", "--steps",
                              "5", "--balanced-sampler", "--checkpoint-dir", str(tmp_path / "ck")], capsys)
    assert code == 0, err
    assert Counter(seen) == {0: 5, 1: 5}, seen
    record = read_checkpoint(list_checkpoints(tmp_path / "ck")[-1].path).record
    assert record.identity["sampler"] == "balanced"
    with pytest.raises(ConfigError, match="--balanced-sampler: draws each class's images equally"):
        dl.train(task="segmentation", model="unet", app="medical", balanced_sampler=True)
