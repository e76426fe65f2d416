"""5 ranks (SP+LP): each spatial rank reads only its tile box of every slide tile; training on
those region reads equals serial training on whole tiles.
Usage: python -m tests.mpi.models_regions [--backend=gloo]: rank 0 writes the test slide (``test_slide``)
into a fresh directory and removes it at the end. Named checks: READS, LOSS (every rank)."""
from __future__ import annotations

import copy
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.data import Batcher, SlideDataset, ihc_image
from mpi4dl_nb.evaluation.batch_inputs import BatchInputs
from mpi4dl_nb.models import resnet_v1
from tests.support.checks import Checks, run_checks
from tests.support.exactness import relative_error
from tests.support.planes import split_backend
from tests.support.pyramid import write_pyramid
from tests.support.slide_recorder import ReadRecorder

SIZE, LEVEL, BATCH = 64, 1, 2
READS = "spatial ranks read only their tile box, other ranks nothing"
LOSS = "loss on region reads equals serial on whole tiles"


def test_slide() -> Path:
    """A 512x512 pyramidal slide with tissue in its top-left 256x384, written by rank 0 into a fresh
    directory; every rank gets its path."""
    path = None
    if MPI.COMM_WORLD.rank == 0:
        image = np.full((512, 512, 3), 255, np.uint8)
        image[:256, :384] = ihc_image()[:256, :384]
        path = Path(tempfile.mkdtemp(prefix="models_regions_")) / "slide.tif"
        write_pyramid(path, image)
    return MPI.COMM_WORLD.bcast(path, root=0)


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    backend, _ = split_backend(sys.argv[1:])
    ctx = dl.init(backend=backend)
    slide_path = test_slide()
    data = SlideDataset([slide_path], SIZE, level=LEVEL, opener=ReadRecorder.open)
    recorder = data.slide(0)
    recorder.calls.clear()   # the tissue filter's read of the coarsest level
    batcher = Batcher(data, BATCH, seed=0)
    cfg = dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4)
    torch.manual_seed(0)
    layers = [layer.double() for layer in resnet_v1(8, 2, width=4)]
    engine = dl.HybridEngine(copy.deepcopy(layers), cfg, ctx, loss_fn=nn.CrossEntropyLoss())
    inputs = BatchInputs(engine, ctx.rank, SIZE, BATCH, torch.float64)
    loss = engine.train_step(inputs.images(lambda rows, box: batcher.images(0, 0, box, rows)), batcher.labels(0, 0))

    with check(READS):
        if ctx.rank < 4:
            r0, r1, c0, c1 = engine.grid.tile_box(ctx.rank, SIZE, SIZE)
            tiles = [data.tiles[i] for i in batcher.indices(0, 0)]
            expected = [(((t.x + c0) * 2, (t.y + r0) * 2), LEVEL, (c1 - c0, r1 - r0)) for t in tiles]
            assert recorder.calls == expected, f"read {recorder.calls}, expected {expected}"
        else:
            assert not recorder.calls, f"stage 1 read the slide: {recorder.calls}"

    with check(LOSS):
        whole = SlideDataset([slide_path], SIZE, level=LEVEL)
        full = torch.stack([whole.read(i) for i in batcher.indices(0, 0)]).double()
        serial = nn.Sequential(*layers)
        ref = nn.functional.cross_entropy(serial(full), batcher.labels(0, 0))
        err = relative_error(torch.tensor(loss, dtype=torch.float64), ref.detach())
        assert err <= 1e-10, f"loss {loss} != serial {ref.item()} (rel {err:.2e})"
    ctx.barrier()
    if ctx.rank == 0:
        shutil.rmtree(slide_path.parent)


if __name__ == "__main__":
    run_checks(main)
