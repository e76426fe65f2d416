"""5 ranks (SP+LP): each spatial rank reads only its tile box of every slide tile; training on
those region reads equals serial training on whole tiles; so does ``train --stain-normalize`` (Macenko on a folder
of slides, each normalised by its overview; Reinhard on the IHC sample, each image by its whole), float64.
Usage: python -m tests.mpi.models_regions [--backend=gloo]: rank 0 writes the test slide (``test_slide``)
into a fresh directory and removes it at the end. Named checks: READS, LOSS, STAIN_CHECKS (every rank)."""
from __future__ import annotations

import copy
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI
from PIL import Image
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.cli.train_cmd import parsed_plan
from mpi4dl_nb.data import Batcher, SlideDataset, ihc_image
from mpi4dl_nb.evaluation.batch_inputs import BatchInputs
from mpi4dl_nb.models import resnet_v1
from mpi4dl_nb.run.job_run import build_trainer, set_up_run
from tests.support.checks import Checks, run_checks
from tests.support.exactness import relative_error
from tests.support.planes import split_backend
from tests.support.pyramid import write_pyramid
from tests.support.scratch import shared_temp_folder
from tests.support.serial_training import train_one_process
from tests.support.slide_recorder import ReadRecorder

SIZE, LEVEL, BATCH = 64, 1, 2
READS = "spatial ranks read only their tile box, other ranks nothing"
LOSS = "loss on region reads equals serial on whole tiles"
STAIN_FLAGS = ("--model resnet --resnet-version 1 --num-layers 8 --num-filters 4 --image-size 64 --batch-size 2 "
               "--num-classes 2 --dtype float64 --steps 2 --no-progress --step-timeout 0 --app medical "
               "--split-size 2 --spatial-size 1 --num-spatial-parts 4").split()
STAIN_DATA = {"macenko": "slides", "reinhard": "sample"}        # method -> the data it normalises here
STAIN_CHECKS = [f"{method} normalised {data}: training equals one process" for method, data in STAIN_DATA.items()]


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
    stain_checks(check, ctx)


def write_stain_data(folder: Path) -> None:
    """Rank 0: two classes of one slide each (the IHC sample, and its colours shifted) and a reference tile."""
    sample = ihc_image()
    for name, image in (("a", sample), ("b", np.clip(sample[::-1] * np.array([1.1, 0.85, 0.95]), 0, 255))):
        (folder / "slides" / name).mkdir(parents=True)
        write_pyramid(folder / "slides" / name / f"{name}.tif", image.astype(np.uint8))
    Image.fromarray((sample[256:, :256] * np.array([0.9, 0.8, 1.0])).astype(np.uint8)).save(folder / "reference.png")


def stain_checks(check: Checks, ctx: dl.Context) -> None:
    """``train --stain-normalize`` set up as the command does (the normaliser fitted on rank 0, broadcast), 2 steps
    of SP+LP against one process on whole normalised images: every loss and the final weights within 1e-9."""
    with shared_temp_folder(ctx, "stain-") as folder:
        if ctx.rank == 0:
            write_stain_data(folder)
        ctx.barrier()
        for (method, data), name in zip(STAIN_DATA.items(), STAIN_CHECKS):
            where = ["--datapath", str(folder / "slides")] if data == "slides" else []
            reference = str(folder / "reference.png")
            argv = [*STAIN_FLAGS, *where, "--stain-normalize", method, "--stain-reference", reference]
            plan = parsed_plan(argv)
            setup = set_up_run(plan, ctx)
            trainer = build_trainer(setup, None)
            summary = trainer.run()
            state = trainer.engine.full_state_dict()
            fitted = ctx.all_gather_object(setup.job.data.stain)
            with check(name) as result:
                assert fitted[0] is not None and fitted[0].method.value == method
                assert all(f == fitted[0] for f in fitted), "the ranks normalise differently"
                if ctx.rank == 0:
                    assert summary is not None and state is not None and setup.batcher is not None
                    dataset = setup.batcher.dataset
                    changed = (dataset.read(0) - dataset.read_pixels(0)).abs().max().item()
                    assert changed > 0.01, f"the normaliser changed the pixels by {changed} only"
                    torch.manual_seed(setup.job.training.seed)
                    model = nn.Sequential(*setup.record.model.build(setup.job.data.image_size)).double()
                    serial = train_one_process(setup, model, nn.CrossEntropyLoss(),
                                               lambda b, e, s: b.labels(e, s), 2)
                    parallel = [float(v) for v in summary.losses if v is not None]
                    worst = max(abs(a - b) for a, b in zip(parallel, serial, strict=True))
                    assert worst < 1e-9, f"losses {parallel} vs one process {serial}"
                    drift = max((state[k].double() - v).abs().max().item() for k, v in model.state_dict().items())
                    assert drift < 1e-9, f"weights differ by {drift}"
                    result.detail = f"losses {worst:.1e}, weights {drift:.1e}"


if __name__ == "__main__":
    run_checks(main)
