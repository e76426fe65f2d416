"""MPI (5 ranks): a torchvision ResNet-18 with its average pool replaced (``--pool max|attention``) on 4 tiles (2x2)
+ 1 layer rank equals one process (float64).

The ranks set the run up as ``python -m mpi4dl_nb train`` does (``parsed_plan``, ``set_up_run``,
``build_trainer``) with ``--model torchvision:resnet18 --image-size 64`` (no weights file: the seed draws them);
rank 0 trains the same model in one process on whole images (``train_one_process``).

Checks: ``--pool P equals one process`` for max and attention (losses and final weights within 1e-9), the pool
replaced in the built network (``GlobalMaxPool`` / ``AttentionMILPool`` at ``avgpool``), and ``--release-heap-every 1``
reaching the engine (a heap release after each step, the results unchanged).
"""

from __future__ import annotations

import torch

import mpi4dl_nb as dl
from mpi4dl_nb.data.dataset import Batcher
from mpi4dl_nb.models.pools import AttentionMILPool, GlobalMaxPool
from mpi4dl_nb.run.job_run import build_trainer
from tests.mpi.finetune_exact import set_up
from tests.support.checks import Checks, run_checks
from tests.support.serial_training import matches_one_process, train_one_process

STEPS = 2
FLAGS = ("--model torchvision:resnet18 --image-size 64 --batch-size 2 --num-samples 4 --num-classes 2 "
         "--dtype float64 --steps 2 --lr 0.001 --no-progress --step-timeout 0 --release-heap-every 1 "
         "--split-size 2 --spatial-size 1 --num-spatial-parts 4 --slice-method square").split()
POOLS = {"max": GlobalMaxPool, "attention": AttentionMILPool}
TOLERANCE = 1e-9


def case_name(pool: str) -> str:
    return f"--pool {pool} equals one process"


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    for pool, kind in POOLS.items():
        setup = set_up([*FLAGS, "--pool", pool], ctx)
        trainer = build_trainer(setup, None)
        run = trainer.run()
        state = trainer.engine.full_state_dict()
        with check(case_name(pool)) as result:
            if ctx.rank == 0:
                assert run is not None and state is not None
                torch.manual_seed(setup.job.training.seed)
                model = torch.nn.Sequential(*setup.record.model.build(setup.job.data.image_size))
                model = model.to(torch.float64)
                assert any(isinstance(m, kind) for m in model[-1].modules()), f"no {kind.__name__} in the head"
                assert trainer.engine.heap.releases == STEPS, "--release-heap-every 1: a release after every step"
                serial = train_one_process(setup, model, torch.nn.CrossEntropyLoss(), Batcher.labels, STEPS)
                result.detail = matches_one_process(run.losses, state, serial, model, TOLERANCE)


if __name__ == "__main__":
    run_checks(main)
