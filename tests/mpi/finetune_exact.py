"""MPI (5 ranks): train's fine-tuning flags are exact against one process, in float64.

The ranks set the run up as ``python -m mpi4dl_nb train`` does (``parsed_plan``, ``set_up_run`` and
``build_trainer`` of run/job_run.py from the command line below) with ``--optimizer adamw --lr-schedule
cosine --warmup-steps 2 --augment flip,rot90,color,hed --class-weights balanced`` and train 4 steps; rank 0
trains the same model in one process from the same flags' optimizer, schedule, loss and augmented batches
(whole images, ``serial_step`` over the layout's chunks). Layouts: SP 2x2 + LP (``sp+lp``) and GEMS on 5
stages (``gems``: two chunks, so the class-weighted loss must add up over micro-batches).

Checks per layout: every step's loss within 1e-9 of one process's, the final weights too, AdamW's moments
and step counts the same on every holder of a stage (bitwise); for ``sp+lp`` also a run resumed from its
step-2 checkpoint continues with the very losses (optimizer state, schedule and augmentation draws).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import mpi4dl_nb as dl
from mpi4dl_nb.cli.train_cmd import parsed_plan
from mpi4dl_nb.loss import classification_loss
from mpi4dl_nb.pipeline.reference import serial_chunks, serial_step
from mpi4dl_nb.run.job_run import JobSetup, build_trainer, set_up_run
from tests.support.checks import Checks, run_checks
from tests.support.planes import split_backend
from tests.support.scratch import shared_temp_folder
from tests.support.serial_training import matches_one_process

STEPS = 4
FLAGS = ("--model resnet --resnet-version 1 --num-layers 8 --num-filters 4 --image-size 32 --batch-size 4 "
         "--num-samples 16 --num-classes 3 --dtype float64 --steps 4 --no-progress --step-timeout 0 "
         "--optimizer adamw --lr 0.01 --weight-decay 0.05 --lr-schedule cosine --warmup-steps 2 "
         "--augment flip,rot90,color,hed --class-weights balanced").split()
LAYOUTS = {"sp+lp": "--split-size 2 --spatial-size 1 --num-spatial-parts 4".split(),
           "gems": "--split-size 5 --spatial-size 0 --times 1 --balance 1,1,1,1,1".split()}
TOLERANCE = 1e-9


def set_up(argv: list[str], ctx: dl.Context) -> JobSetup:
    return set_up_run(parsed_plan(argv), ctx)


def one_process(setup: JobSetup) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The run in one process: the flags' model, optimizer, schedule, loss and (whole, augmented) batches."""
    job, training, batcher = setup.job, setup.record.training, setup.batcher
    assert training is not None and batcher is not None
    torch.manual_seed(job.training.seed)
    model = torch.nn.Sequential(*setup.record.model.build(job.data.image_size)).to(torch.float64)
    optimizer = training.optimizer.build(model.parameters())
    loss_fn = classification_loss(training.class_weights)
    chunks = serial_chunks(job.config, job.training.batch_size)
    losses = []
    for step in range(STEPS):
        epoch, in_epoch = divmod(step, batcher.steps_per_epoch)
        training.schedule.apply(optimizer, step)
        images = batcher.images(epoch, in_epoch).to(torch.float64)
        losses.append(serial_step(model, optimizer, loss_fn, images, batcher.labels(epoch, in_epoch), chunks))
    return losses, model.state_dict()


def moments(engine: dl.HybridEngine) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's optimizer state per whole-model parameter name (every copy it holds)."""
    assert engine.optimizer is not None
    mine: dict[str, dict[str, torch.Tensor]] = {}
    for key, inst in engine.instances.items():
        for name, param in inst.canonical.named_parameters():
            state = engine.optimizer.state.get(param, {})
            mine[f"{key} {inst.canonical.full_key(name)}"] = {k: v.detach().clone() for k, v in state.items()}
    return mine


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    backend, names = split_backend(sys.argv[1:])
    ctx = dl.init(backend=backend)
    with shared_temp_folder(ctx, "finetune-") as folder:
        for name, layout in LAYOUTS.items():
            if names and name not in names:
                continue
            argv = [*FLAGS, *layout]
            if name == "sp+lp":
                argv += ["--checkpoint-dir", str(Path(folder) / name), "--checkpoint-every", "2",
                         "--keep-checkpoints", "2"]
            setup = set_up(argv, ctx)
            trainer = build_trainer(setup, None)
            summary = trainer.run()
            state = trainer.engine.full_state_dict()
            with check(f"{name} losses equal one process") as result:
                if ctx.rank == 0:
                    assert summary is not None and state is not None
                    serial, serial_state = one_process(setup)
                    result.detail = matches_one_process(summary.losses, state, serial, serial_state, TOLERANCE)
            with check(f"{name} adamw state equal on every holder"):
                gathered = ctx.gather_object(moments(trainer.engine), root=0)
                if gathered is not None:
                    by_param: dict[str, list[dict[str, torch.Tensor]]] = {}
                    for part in gathered:
                        for key, entry in part.items():
                            by_param.setdefault(key.split(" ", 2)[-1], []).append(entry)
                    assert by_param and all(entries[0] for entries in by_param.values()), "no AdamW state"
                    for key, entries in by_param.items():
                        for other in entries[1:]:
                            assert other.keys() == entries[0].keys(), key
                            assert all(torch.equal(other[k], entries[0][k]) for k in other), f"{key} differs"
            if name != "sp+lp":
                continue
            with check("sp+lp resumed run continues exactly"):
                step2 = next(p for p in (Path(folder) / name).glob("step-00000002-*.pt"))
                resumed = set_up([*argv, "--resume", str(step2)], ctx)
                again = build_trainer(resumed, None)
                assert again.restore(resumed.selection.checkpoint if resumed.selection else None) == 2
                rest = again.run()
                if ctx.rank == 0:
                    assert summary is not None and rest is not None
                    assert rest.losses == summary.losses[2:], f"{rest.losses} vs {summary.losses[2:]}"


if __name__ == "__main__":
    run_checks(main)
