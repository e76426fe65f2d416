"""MPI (4 ranks): ``train --task segmentation --model unet3d`` on a folder of volumes, 1x2x2 tiles, equals one process.

The ranks set the run up as ``python -m mpi4dl_nb train`` does (``parsed_plan``, then ``set_up_run``,
``build_trainer`` of run/job_run.py) on a folder of three volumes that rank 0 writes (ImageJ TIFF stacks and a NIfTI,
8x32x32 voxels of 1 x 0.5 x 0.5 µm, 2 classes) read at ``--voxel-size 1`` (8x16x16), one volume held out
(``--val-fraction``), checkpointed after 2 steps, then resumed to step 3 (``started_trainer``); rank 0 trains the
same model in one process on whole volumes (``serial_step``) and evaluates it on the whole held-out volume.

Checks: ``volume losses equal one process`` (float64, 1e-9, and the final weights); ``held-out volumes equal one
process`` (val_loss within 1e-9, the confusion matrix and each volume's Dice equal, after step 2 and after the
resumed step 3); ``resume equals three straight steps`` (the resumed step's loss and every weight within 1e-9 of
three steps in one process); ``each rank reads its tile`` (every region a rank reads of a volume file, images and
label volumes, in training and evaluation, is the footprint of its own tile of the 1x2x2 grid: the source voxels
the area shrink of that tile reads, no more).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import mpi4dl_nb as dl
from mpi4dl_nb.cli.train_cmd import parsed_plan
from mpi4dl_nb.data.masks import batch_masks
from mpi4dl_nb.data.volume.resample import VolumeResampler
from mpi4dl_nb.evaluation.pixel_metrics import confusion_counts, sample_dice
from mpi4dl_nb.run.job_run import JobSetup, build_trainer, set_up_run, started_trainer
from mpi4dl_nb.run.summary import TrainSummary
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.support.checks import Checks, run_checks
from tests.support.scratch import shared_temp_folder
from tests.support.serial_training import matches_one_process, train_one_process
from tests.support.volume_data import recorded_reads, write_volume_pairs

STEPS = 2
SHAPE = (8, 32, 32)                    # the files' voxels; the patch is 8x16x16 at --voxel-size 1
PATCH = (8, 16, 16)
FLAGS = ("--task segmentation --model unet3d --num-filters 4 --num-classes 2 --image-size 8,16,16 --batch-size 2 "
         "--voxel-size 1 --dtype float64 --no-progress --step-timeout 0 --loss ce+dice --class-weights 1,2 "
         "--val-fraction 0.34 --momentum 0.9").split()
TILES = "--split-size 1 --spatial-size 1 --num-spatial-parts 4 --slice-method 1x2x2".split()
TOLERANCE = 1e-9


def one_process(setup: JobSetup, steps: int = STEPS) -> tuple[list[float], torch.nn.Module]:
    """The run in one process: the record's model, optimizer and loss on whole volumes and label volumes."""
    torch.manual_seed(setup.job.training.seed)
    model = torch.nn.Sequential(*setup.record.model.build(setup.job.data.volume_size)).to(torch.float64)
    return train_one_process(setup, model, setup.record.loss(), batch_masks, steps), model


def held_out_matches(summary: TrainSummary, setup: JobSetup, model: torch.nn.Module) -> str:
    """Assert the run's held-out figures equal ``model``'s (eval mode, one process, whole volumes); the detail."""
    dataset = setup.val_dataset
    assert dataset is not None
    images = torch.stack([dataset.read(i).to(torch.float64) for i in range(len(dataset))])
    masks = torch.stack([dataset.read_mask(i) for i in range(len(dataset))])
    model.eval()
    with torch.no_grad():
        logits = model(images)
    loss = setup.record.loss()
    value = float(loss.value(loss.sums(logits, masks)))
    each = [confusion_counts(m.numpy(), p.numpy(), 2, loss.ignore_index) for m, p in zip(masks, logits.argmax(1))]
    figures = summary.as_dict()
    assert abs(figures["val_loss"] - value) < TOLERANCE, f"val_loss {figures['val_loss']} vs {value}"
    assert figures["val_confusion_matrix"] == sum(each).tolist(), f"{figures['val_confusion_matrix']} vs {sum(each)}"
    assert figures["val_volume_dice"] == [sample_dice(m) for m in each], figures["val_volume_dice"]
    return (f"step {figures['val_step']}: val_loss error {abs(figures['val_loss'] - value):.1e}, Dice per volume "
            f"{[round(d, 4) for d in figures['val_volume_dice']]} equal")


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    with shared_temp_folder(ctx, "volumes-") as folder:
        if ctx.rank == 0:
            write_volume_pairs(Path(folder) / "volumes", shape=SHAPE, classes=2, names=("a", "b", "c"))
        ctx.barrier()
        argv = [*FLAGS, *TILES, "--datapath", str(Path(folder) / "volumes"), "--checkpoint-dir",
                str(Path(folder) / "ck")]
        plan = parsed_plan([*argv, "--steps", str(STEPS)])
        with recorded_reads(SHAPE) as regions:
            setup = set_up_run(plan, ctx)
            trainer = build_trainer(setup, None)
            regions.clear()                  # the data check read whole label volumes; training reads tiles
            summary = trainer.run()
            state = trainer.engine.full_state_dict()
        read_in_training = list(regions)
        resumed_trainer = started_trainer(parsed_plan([*argv, "--steps", str(STEPS + 1), "--resume", "latest"]), ctx,
                                          None)
        resumed = resumed_trainer.run()
        resumed_state = resumed_trainer.engine.full_state_dict()
        serial = serial_model = None
        with check("volume losses equal one process") as result:
            if ctx.rank == 0:
                assert summary is not None and state is not None
                serial, serial_model = one_process(setup)
                result.detail = matches_one_process(summary.losses, state, serial, serial_model, TOLERANCE)
        three, three_model = one_process(setup, STEPS + 1) if ctx.rank == 0 else ([], None)
        with check("held-out volumes equal one process") as result:
            if ctx.rank == 0:
                assert summary is not None and serial_model is not None and resumed is not None
                assert three_model is not None
                result.detail = "; ".join([held_out_matches(summary, setup, serial_model),
                                           held_out_matches(resumed, setup, three_model)])
        with check("resume equals three straight steps") as result:
            if ctx.rank == 0:
                assert resumed is not None and resumed_state is not None and resumed.start_step == STEPS
                assert three_model is not None
                result.detail = matches_one_process(resumed.losses, resumed_state, three[STEPS:], three_model,
                                                    TOLERANCE)
        with check("each rank reads its tile") as result:
            shrink = VolumeResampler((1.0, 2.0, 2.0))
            footprints = [tuple((a, min(b, n)) for (a, b), n in zip(shrink.source_box(tile), SHAPE))
                          for tile in TileGrid(depth=1, rows=2, cols=2).extents(PATCH)]
            names = {name for name, _ in read_in_training}
            boxes = {box for _, box in read_in_training}
            assert names == {"a.tif", "b.nii.gz", "c.tif"}, f"rank {ctx.rank} read {names}"
            assert len(boxes) == 1 and next(iter(boxes)) in footprints, f"rank {ctx.rank} read {sorted(boxes)}"
            everyone = ctx.all_gather_object(next(iter(boxes)))
            assert sorted(everyone) == sorted(footprints), f"the ranks read {everyone}, the tiles' are {footprints}"
            voxels = int(np.prod([b - a for a, b in next(iter(boxes))]))
            result.detail = f"{len(read_in_training)} reads of {voxels} voxels each (of {int(np.prod(SHAPE))})"


if __name__ == "__main__":
    run_checks(main)
