"""MPI (4 ranks): ``train --task segmentation --model unet3d`` on a folder of volumes, 1x2x2 tiles, equals one process.

The ranks set the run up as ``python -m mpi4dl_nb train`` does (``parse_launch``, ``train_job``, then ``prepare``,
``build_trainer`` of run/job_run.py) on a folder of two volumes that rank 0 writes (an ImageJ TIFF stack and a NIfTI,
8x32x32 voxels of 1 x 0.5 x 0.5 µm, 2 classes) read at ``--voxel-size 1`` (8x16x16); rank 0 trains the same model
in one process on whole volumes (``serial_step``).

Checks: ``volume losses equal one process`` (float64, 1e-9, and the final weights); ``each rank reads its tile``
(every region a rank reads of a volume file, images and label volumes, is the footprint of its own tile of the
1x2x2 grid: the source voxels the area shrink of that tile reads, no more).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import mpi4dl_nb as dl
from mpi4dl_nb.cli.setup import parse_launch
from mpi4dl_nb.cli.train_cmd import build_parser, check_run_args
from mpi4dl_nb.cli.train_job import train_job
from mpi4dl_nb.data import volume_dataset
from mpi4dl_nb.data.masks import batch_masks
from mpi4dl_nb.data.volume_resample import VolumeResampler
from mpi4dl_nb.run.job_run import JobSetup, build_trainer, prepare
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.support.checks import Checks, run_checks
from tests.support.scratch import shared_temp_folder
from tests.support.serial_training import matches_one_process, train_one_process
from tests.support.volume_data import write_volume_pairs

STEPS = 2
SHAPE = (8, 32, 32)                    # the files' voxels; the patch is 8x16x16 at --voxel-size 1
PATCH = (8, 16, 16)
FLAGS = ("--task segmentation --model unet3d --num-filters 4 --num-classes 2 --image-size 8,16,16 --batch-size 2 "
         "--voxel-size 1 --dtype float64 --steps 2 --no-progress --step-timeout 0 --loss ce+dice "
         "--class-weights 1,2").split()
TILES = "--split-size 1 --spatial-size 1 --num-spatial-parts 4 --slice-method 1x2x2".split()
TOLERANCE = 1e-9


def one_process(setup: JobSetup) -> tuple[list[float], torch.nn.Module]:
    """The run in one process: the record's model, optimizer and loss on whole volumes and label volumes."""
    torch.manual_seed(setup.job.training.seed)
    model = torch.nn.Sequential(*setup.record.model.build(setup.job.data.volume_size)).to(torch.float64)
    return train_one_process(setup, model, setup.record.loss(), batch_masks, STEPS), model


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    regions: list[tuple[str, tuple[tuple[int, int], ...]]] = []
    original = volume_dataset.read_volume

    def recording(path, region=None):       # every region this rank reads of a volume file
        regions.append((Path(path).name, tuple(part.indices(n)[:2] for part, n in zip(region, SHAPE))))
        return original(path, region)

    volume_dataset.read_volume = recording
    with shared_temp_folder(ctx, "volumes-") as folder:
        if ctx.rank == 0:
            write_volume_pairs(Path(folder) / "volumes", shape=SHAPE, classes=2)
        ctx.barrier()
        argv = [*FLAGS, *TILES, "--datapath", str(Path(folder) / "volumes")]
        args, cfg = parse_launch(build_parser(), argv, check_run_args)
        setup = prepare(train_job(args, cfg), ctx)
        trainer = build_trainer(setup, None)
        regions.clear()                      # the data check read whole label volumes; training reads tiles
        summary = trainer.run()
        state = trainer.engine.full_state_dict()
        read_in_training = list(regions)
        volume_dataset.read_volume = original
        with check("volume losses equal one process") as result:
            if ctx.rank == 0:
                assert summary is not None and state is not None
                serial, serial_model = one_process(setup)
                result.detail = matches_one_process(summary.losses, state, serial, serial_model, TOLERANCE)
        with check("each rank reads its tile") as result:
            shrink = VolumeResampler((1.0, 2.0, 2.0))
            footprints = [tuple((a, min(b, n)) for (a, b), n in zip(shrink.source_box(tile), SHAPE))
                          for tile in TileGrid(depth=1, rows=2, cols=2).extents(PATCH)]
            names = {name for name, _ in read_in_training}
            boxes = {box for _, box in read_in_training}
            assert names == {"a.tif", "b.nii.gz"}, f"rank {ctx.rank} read {names}"
            assert len(boxes) == 1 and next(iter(boxes)) in footprints, f"rank {ctx.rank} read {sorted(boxes)}"
            everyone = ctx.all_gather_object(next(iter(boxes)))
            assert sorted(everyone) == sorted(footprints), f"the ranks read {everyone}, the tiles' are {footprints}"
            voxels = int(np.prod([b - a for a, b in next(iter(boxes))]))
            result.detail = f"{len(read_in_training)} reads of {voxels} voxels each (of {int(np.prod(SHAPE))})"

if __name__ == "__main__":
    run_checks(main)
