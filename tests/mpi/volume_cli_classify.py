"""MPI (3 ranks): ``train --task classification --model resnet3d`` on class folders of volumes equals one process.

The ranks set the run up as ``python -m mpi4dl_nb train`` does (``parsed_plan``, ``set_up_run``,
``build_trainer`` of run/job_run.py) on two class folders of three volumes each that rank 0 writes (ImageJ TIFF stacks
and NIfTI, 16x32x32 voxels of 1 x 0.5 x 0.5 µm) read at ``--voxel-size 1`` (16x16x16 patches), ``--split-size 2
--spatial-size 1 --slice-method 1x1x2``: the ResNet's spatial stage on 1x1x2 tiles (ranks 0, 1) before a layer stage
(rank 2), one volume of each class held out (``--val-fraction``); rank 0 trains the same model in one process on
whole volumes and evaluates it on the held-out volumes.

Checks: ``volume classes equal one process`` (float64, 2 steps: losses and every weight of the final model within
1e-9); ``held-out volume classes equal one process`` (val_loss within 1e-9, the confusion matrix equal);
``each rank reads its tile`` (the spatial ranks read, of every volume file, only the footprint of their own tile of
the 1x1x2 grid; the layer rank reads none).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

import mpi4dl_nb as dl
from mpi4dl_nb.cli.train_cmd import parsed_plan
from mpi4dl_nb.comm.protocol import Comm
from mpi4dl_nb.data.dataset import Batcher
from mpi4dl_nb.data.volume.resample import VolumeResampler
from mpi4dl_nb.run.job_run import JobSetup, build_trainer, set_up_run
from mpi4dl_nb.run.summary import TrainSummary
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.support.checks import Checks, run_checks
from tests.support.scratch import shared_temp_folder
from tests.support.serial_training import matches_one_process, train_one_process
from tests.support.volume_data import recorded_reads, write_volume_classes

STEPS = 2
SHAPE = (16, 32, 32)                   # the files' voxels; the patch is 16x16x16 at --voxel-size 1
PATCH = (16, 16, 16)
CLASSES = {"benign": ("a", "b", "e"), "tumour": ("c", "d", "f")}
FLAGS = ("--task classification --model resnet3d --num-filters 2 --image-size 16,16,16 --batch-size 2 "
         "--voxel-size 1 --dtype float64 --no-progress --step-timeout 0 --val-fraction 0.34 --momentum 0.9").split()
TILES = "--split-size 2 --spatial-size 1 --num-spatial-parts 2 --slice-method 1x1x2".split()
TOLERANCE = 1e-9


def one_process(setup: JobSetup) -> tuple[list[float], torch.nn.Module]:
    """The run in one process: the record's model and optimizer, cross-entropy on whole volumes."""
    torch.manual_seed(setup.job.training.seed)
    model = torch.nn.Sequential(*setup.record.model.build(setup.job.data.volume_size)).to(torch.float64)
    return train_one_process(setup, model, torch.nn.CrossEntropyLoss(), Batcher.labels, STEPS), model


def held_out_matches(summary: TrainSummary, setup: JobSetup, model: torch.nn.Module) -> str:
    """Assert the run's held-out figures equal ``model``'s (eval mode, one process, whole volumes); the detail."""
    dataset = setup.val_dataset
    assert dataset is not None
    volumes = torch.stack([dataset.read(i).to(torch.float64) for i in range(len(dataset))])
    labels = torch.tensor([dataset.label(i) for i in range(len(dataset))])
    model.eval()
    with torch.no_grad():
        logits = model(volumes)
    value = float(torch.nn.functional.cross_entropy(logits, labels))
    confusion = [[0, 0], [0, 0]]
    for truth, guess in zip(labels.tolist(), logits.argmax(1).tolist(), strict=True):
        confusion[truth][guess] += 1
    figures = summary.as_dict()
    assert figures["val_count"] == len(dataset) == 2, figures["val_count"]
    assert abs(figures["val_loss"] - value) < TOLERANCE, f"val_loss {figures['val_loss']} vs {value}"
    assert figures["val_confusion_matrix"] == confusion, f"{figures['val_confusion_matrix']} vs {confusion}"
    return (f"step {figures['val_step']}: val_loss {value:.6f} error {abs(figures['val_loss'] - value):.1e}, "
            f"confusion {confusion} equal")


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    with shared_temp_folder(ctx, "volume-classes-") as folder:
        if ctx.rank == 0:
            write_volume_classes(Path(folder) / "volumes", shape=SHAPE, classes=CLASSES)
        ctx.barrier()
        argv = [*FLAGS, *TILES, "--datapath", str(Path(folder) / "volumes"), "--steps", str(STEPS)]
        plan = parsed_plan(argv)
        with recorded_reads(SHAPE) as regions:
            setup = set_up_run(plan, ctx)
            trainer = build_trainer(setup, None)
            regions.clear()                  # training and evaluation read tiles
            summary = trainer.run()
            state = trainer.engine.full_state_dict()
        read = list(regions)
        compare(check, ctx, setup, summary, state)      # the files are still there: one process reads them
    with check("each rank reads its tile") as result:
        shrink = VolumeResampler((1.0, 2.0, 2.0))
        footprints = [tuple((a, min(b, n)) for (a, b), n in zip(shrink.source_box(tile), SHAPE))
                      for tile in TileGrid(depth=1, rows=1, cols=2).extents(PATCH)]
        names = {name for name, _ in read}
        boxes = sorted({box for _, box in read})
        everyone = ctx.all_gather_object(boxes)
        readers = [b for b in everyone if b]
        assert len(readers) == 2 and all(len(b) == 1 for b in readers), f"the ranks read {everyone}"
        assert sorted(b[0] for b in readers) == sorted(footprints), f"the ranks read {everyone}, tiles {footprints}"
        if boxes:
            assert len(names) == 6, f"rank {ctx.rank} read {sorted(names)}"
        result.detail = f"rank {ctx.rank}: {len(read)} reads of {boxes[0] if boxes else 'nothing'}"


def compare(check: Checks, ctx: Comm, setup: JobSetup, summary: TrainSummary | None,
            state: Mapping[str, torch.Tensor] | None) -> None:
    """The checks against one process (rank 0)."""
    serial_model = None
    with check("volume classes equal one process") as result:
        if ctx.rank == 0:
            assert summary is not None and state is not None
            assert setup.record.class_names == ("benign", "tumour"), setup.record.class_names
            serial, serial_model = one_process(setup)
            result.detail = matches_one_process(summary.losses, state, serial, serial_model, TOLERANCE)
    with check("held-out volume classes equal one process") as result:
        if ctx.rank == 0:
            assert summary is not None and serial_model is not None
            result.detail = held_out_matches(summary, setup, serial_model)

if __name__ == "__main__":
    run_checks(main)
