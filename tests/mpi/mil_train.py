"""MPI (5 ranks): ``train --pool max|attention --accumulate 2`` on SP 2x2 + LP equals one process in float64 (issue 43).

The ranks set the run up as ``python -m mpi4dl_nb train`` does (``parsed_plan``, ``set_up_run``,
``build_trainer``) on synthetic images and train 2 optimizer steps of 2 batches each; rank 0 trains the flags' model
in one process on the same batches (each optimizer step over batches ``2s`` and ``2s + 1`` of the Batcher:
``serial_accumulated_step``). Checks per pool: the losses (one per optimizer step) and the final weights (BatchNorm
statistics included) within 1e-9; ``--pool tissue-mean`` on 3-channel data refused before any step, naming --pool.
"""

from __future__ import annotations

import torch

import mpi4dl_nb as dl
from mpi4dl_nb.comm.agreement import SetupFailed
from mpi4dl_nb.data.dataset import Batcher
from mpi4dl_nb.loss import classification_loss
from mpi4dl_nb.run.job_run import JobSetup, build_trainer
from tests.mpi.finetune_exact import set_up
from tests.support.checks import Checks, run_checks
from tests.support.serial_training import matches_one_process, train_one_process

STEPS, ACCUMULATE = 2, 2
FLAGS = ("--model resnet --resnet-version 1 --num-layers 8 --num-filters 4 --image-size 32 --batch-size 2 "
         "--num-samples 8 --num-classes 2 --dtype float64 --steps 2 --accumulate 2 --no-progress --step-timeout 0 "
         "--lr 0.1 --split-size 2 --spatial-size 1 --num-spatial-parts 4 --balance 4,1").split()
POOLS = ("max", "attention")
TOLERANCE = 1e-9
CHECKS = [*(f"train --pool {pool} --accumulate 2 equals one process" for pool in POOLS),
          "train --pool tissue-mean refused on 3-channel data"]


def one_process(setup: JobSetup) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The run in one process on whole images, ``--accumulate 2`` as one optimizer step over two batches."""
    torch.manual_seed(setup.job.training.seed)
    model = torch.nn.Sequential(*setup.record.model.build(setup.job.data.image_size)).to(torch.float64)
    losses = train_one_process(setup, model, classification_loss(None), Batcher.labels, STEPS)
    return losses, model.state_dict()


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    for pool in POOLS:
        with check(f"train --pool {pool} --accumulate 2 equals one process") as result:
            setup = set_up([*FLAGS, "--pool", pool], ctx)
            trainer = build_trainer(setup, None)
            summary = trainer.run()
            state = trainer.engine.full_state_dict()
            if ctx.rank == 0:
                assert summary is not None and state is not None
                serial, serial_state = one_process(setup)
                result.detail = matches_one_process(summary.losses, state, serial, serial_state, TOLERANCE)
    with check("train --pool tissue-mean refused on 3-channel data") as result:
        try:
            set_up([*FLAGS, "--pool", "tissue-mean"], ctx)
        except (SetupFailed, dl.ConfigError) as error:
            assert "--pool tissue-mean" in str(error) and "3 channels" in str(error), str(error)
            result.detail = str(error)[:120]
        else:
            raise AssertionError("no refusal")
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
