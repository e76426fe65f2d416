"""``train --accumulate N --pool KIND`` (issue 43): in one process, N batches per optimizer step (an epoch of 4
batches is 2 steps, one loss each, the checkpoint at the step boundary), the pool recorded in the checkpoint and
rebuilt by ``evaluate``, bad values refused naming the flag; on 5 ranks (SP 2x2 + LP) equal to one process
(tests/mpi/mil_train.py, in the shared 5-rank launch)."""

from __future__ import annotations

import pytest

from mpi4dl_nb.cli import evaluate_cmd
from mpi4dl_nb.cli import train_cmd as cli
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.models.pools import PoolKind
from mpi4dl_nb.models.spec import ModelSpec
from mpi4dl_nb.run.job import TrainJob
from tests.mpi.mil_train import CHECKS
from tests.support.battery import shared_job
from tests.support.summary import json_record

MODEL = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4", "--image-size", "32",
         "--dtype", "float64", "--split-size", "1", "--spatial-size", "0"]
DATA = ["--app", "synthetic", "--num-samples", "8", "--num-classes", "2"]
JOB = shared_job(5, "mil_train", timeout=300)


def test_train_with_pool_and_accumulate_on_five_ranks_equals_one_process(shared_launch):
    shared_launch(JOB).require(CHECKS)


def test_accumulated_steps_checkpoint_at_step_boundaries_and_keep_the_pool(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert cli.main([*MODEL, *DATA, "--batch-size", "2", "--accumulate", "2", "--pool", "attention",
                     "--num-epochs", "1", "--checkpoint-dir", str(ckpt), "--no-progress"]) == 0
    trained = json_record(capsys.readouterr().out)
    assert trained["steps"] == trained["steps_run"] == 2 and len(trained["losses"]) == 2
    assert trained["checkpoint"].endswith(".pt") and "step-00000002" in trained["checkpoint"]
    assert [p.name for p in ckpt.glob("*.pt")] == [trained["checkpoint"].rsplit("/", 1)[1]]
    assert evaluate_cmd.main(["--checkpoint", str(ckpt), "--split-size", "1", "--spatial-size", "0", *DATA]) == 0
    evaluated = json_record(capsys.readouterr().out, '{"checkpoint"')
    assert "attention pool" in evaluated["model"] and evaluated["step"] == 2


def test_pool_and_accumulate_reach_the_job():
    job = TrainJob.of(pool="tissue-mean", accumulate=3).check()
    assert job.model.pool is PoolKind.TISSUE_MEAN and job.model.input_channels == 4
    assert job.training.accumulate == 3


@pytest.mark.parametrize("keywords,flag", [(dict(accumulate=0), "--accumulate"),
                                           (dict(pool="tissue-mean", model="timm:resnet18"), "--pool")])
def test_bad_pool_or_accumulate_is_refused_naming_the_flag(keywords, flag):
    with pytest.raises(ConfigError, match=flag):
        TrainJob.of(**keywords)


def test_a_dense_model_pools_nothing_and_a_named_one_carries_no_tissue_mask():
    with pytest.raises(ValueError, match="--pool max: a unet outputs a class per pixel"):
        ModelSpec.of("unet", pool="max")
    with pytest.raises(ValueError, match="--pool tissue-mean: only the built-in classifiers"):
        ModelSpec.of("torchvision:resnet18", pool="tissue-mean")
    assert ModelSpec.of("torchvision:resnet18", pool="max").pool is PoolKind.MAX
    spec = ModelSpec.of("resnet", pool="max")
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    old = {k: v for k, v in spec.to_dict().items() if k != "pool"}   # a checkpoint from before the field
    assert ModelSpec.from_dict(old).pool is PoolKind.AVG
