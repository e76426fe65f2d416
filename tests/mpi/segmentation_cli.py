"""MPI (4 ranks): ``train --task segmentation`` on 4 tiles (every stage spatial) equals one process (float64).

The ranks set the run up as ``python -m mpi4dl_nb train`` does (``parsed_plan``, then ``set_up_run``,
``build_trainer`` of run/job_run.py) on a folder of 8 image/mask pairs that rank 0 writes (3 classes, a band of ignored
pixels), with ``--loss ce+dice --class-weights 1,2,3 --ignore-index 255``; rank 0 trains the same model in one
process (whole images and masks, ``serial_step``) and evaluates its held-out images.

Checks: ``losses equal one process`` (1e-9, and the weights); ``evaluation equals one process`` (the
summary's held-out confusion matrix, integer counts, and loss); ``evaluate on tiles`` (``evaluate`` of the
checkpoint on 4 tiles gives the training run's figures); ``checkpoint record`` (task, model, classes, loss).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import mpi4dl_nb as dl
from mpi4dl_nb.checkpoint.record import read_checkpoint
from mpi4dl_nb.cli import evaluate_cmd
from mpi4dl_nb.cli.train_cmd import parsed_plan
from mpi4dl_nb.comm.agreement import agreed
from mpi4dl_nb.data.masks import batch_masks
from mpi4dl_nb.data.task import Task
from mpi4dl_nb.evaluation.pixel_metrics import confusion_counts
from mpi4dl_nb.run.evaluate_run import Evaluation
from mpi4dl_nb.run.job_run import JobSetup, build_trainer, set_up_run
from tests.support.checks import Checks, run_checks
from tests.support.scratch import shared_temp_folder
from tests.support.segmentation_data import IGNORED, write_pairs
from tests.support.serial_training import matches_one_process, train_one_process

STEPS = 2
FLAGS = ("--task segmentation --model unet --num-layers 2 --num-filters 4 --num-classes 3 --image-size 64 "
         "--batch-size 2 --dtype float64 --steps 2 --val-fraction 0.25 --no-progress --step-timeout 0 "
         f"--loss ce+dice --class-weights 1,2,3 --ignore-index {IGNORED}").split()
TILES = "--split-size 1 --spatial-size 1 --num-spatial-parts 4".split()
TOLERANCE = 1e-9


def one_process(setup: JobSetup) -> tuple[list[float], torch.nn.Module]:
    """The run in one process: the record's model, optimizer and loss on whole images and masks."""
    torch.manual_seed(setup.job.training.seed)
    model = torch.nn.Sequential(*setup.record.model.build(setup.job.data.image_size)).to(torch.float64)
    return train_one_process(setup, model, setup.record.loss(), batch_masks, STEPS), model


def serial_evaluation(setup: JobSetup, model: torch.nn.Module) -> tuple[list[list[int]], float]:
    """The held-out confusion matrix and loss of ``model`` in one process."""
    held = setup.val_dataset
    assert held is not None
    model.eval()
    with torch.no_grad():
        images = torch.stack([held.read(i) for i in range(len(held))]).to(torch.float64)
        masks = torch.stack([held.read_mask(i) for i in range(len(held))])  # type: ignore[attr-defined]
        logits = model(images)
    loss = float(setup.record.loss()(logits, masks))
    matrix = confusion_counts(masks.numpy(), logits.argmax(1).numpy(), 3, IGNORED)
    return matrix.tolist(), loss


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    with shared_temp_folder(ctx, "segmentation-") as folder:
        if ctx.rank == 0:
            write_pairs(Path(folder) / "pairs", ignored=True)
        ctx.barrier()
        argv = [*FLAGS, *TILES, "--datapath", str(Path(folder) / "pairs"), "--checkpoint-dir", str(Path(folder) / "c")]
        plan = parsed_plan(argv)
        setup = set_up_run(plan, ctx)
        trainer = build_trainer(setup, None)
        summary = trainer.run()
        state = trainer.engine.full_state_dict()
        serial_model = None
        with check("losses equal one process") as result:
            if ctx.rank == 0:
                assert summary is not None and state is not None
                serial, serial_model = one_process(setup)
                result.detail = matches_one_process(summary.losses, state, serial, serial_model, TOLERANCE)
        with check("evaluation equals one process") as result:
            if ctx.rank == 0:
                assert summary is not None and summary.validation is not None and serial_model is not None
                figures = summary.validation.metrics.as_dict()
                matrix, loss = serial_evaluation(setup, serial_model)
                assert figures["confusion_matrix"] == matrix, f"{figures['confusion_matrix']} vs {matrix}"
                assert abs(float(figures["loss"]) - loss) < TOLERANCE, f"{figures['loss']} vs {loss}"
                assert len(figures["dice"]) == 3 and figures["task"] == "segmentation"
                result.detail = f"{np.sum(matrix)} pixels, dice {figures['dice']}"
        with check("evaluate on tiles") as result:
            wanted = summary.validation.metrics.as_dict() if summary is not None and summary.validation else None
            eval_args = evaluate_cmd.evaluate_parser().parse_args(
                ["--checkpoint", str(Path(folder) / "c"), "--datapath", str(Path(folder) / "pairs"), *TILES])
            evaluation = Evaluation(evaluate_cmd.evaluate_plan(eval_args), ctx)
            agreed(ctx, evaluation.read)
            agreed(ctx, evaluation.open_data)
            agreed(ctx, evaluation.load)
            got = evaluation.run()
            if ctx.rank == 0:
                assert got is not None and wanted is not None
                figures = got.metrics.as_dict()
                assert figures["confusion_matrix"] == wanted["confusion_matrix"]
                assert abs(float(figures["loss"]) - float(wanted["loss"])) < TOLERANCE
                result.detail = f"loss {figures['loss']:.6f}"
        with check("checkpoint record"):
            if ctx.rank == 0:
                assert summary is not None and summary.checkpoint is not None
                record = read_checkpoint(summary.checkpoint).record
                assert record.task is Task.SEGMENTATION and str(record.model.family) == "unet"
                assert record.class_names == ("0", "1", "2") and record.model.num_classes == 3
                assert record.segmentation is not None and record.segmentation.loss == "ce+dice"
                assert record.segmentation.ignore_index == IGNORED


if __name__ == "__main__":
    run_checks(main)
