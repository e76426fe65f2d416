"""MPI (4 ranks): a classifier with every stage spatial trains on its P tile ranks alone, its loss on the joined logits
every tile holds, exactly as one process (float64), and ``evaluate`` takes its checkpoint (issue 80, item 3).

Runs set up as ``python -m mpi4dl_nb train`` does (``train_plan``, ``set_up_run``, ``build_trainer``), 2 steps of
AdamW; rank 0 of each run's ranks trains the record's model in one process (whole images, the layout's chunks) and
compares the losses and every weight (1e-9). Models: the package's ResNet (depth 8, 4 filters, BatchNorm) at 32 px and
timm's Swin-T cut to one block per stage, 8 wide, 4 x 4 windows, at 64 px. Layouts: ``--split-size 1
--spatial-size 1`` on 2 tiles (ranks 0-1 and 2-3 run the two models at once, each pair a communicator of its own) and
Swin on 4 tiles (2x2);
ResNet on ``--split-size 2 --spatial-size 2`` with 2 tiles (two spatial stages, 4 ranks). After each run
``evaluate`` reads its checkpoint on the same layout: the loss of the model's checkpoint evaluated in one process
(rank 0 alone, once per model: every layout trains the same weights).

And from Python (ResNet on 4 tiles): ``HybridEngine`` with ``nn.CrossEntropyLoss`` and no optimizer leaves on every
rank the loss, every parameter's gradient (the head's counted once, the trunk's tile shares summed) and the BatchNorm
statistics of one process.

Then ``infer`` of the ResNet checkpoint of 2 tiles, tile-level and fully convolutional, on the 2 tiles and in one
process: the same probability maps.

Checks, per case: ``<case>: train equals one process``, ``<case>: evaluate equals one process``; then
``resnet on 2 tiles: infer on the tiles equals one process`` and ``python: every gradient equals one process``.

Usage: python -m tests.mpi.joined_head_cli   (4 ranks)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.cli.evaluate_cmd import evaluate_parser, evaluate_plan
from mpi4dl_nb.cli.infer_cmd import parse_job
from mpi4dl_nb.cli.train_cmd import train_parser, train_plan
from mpi4dl_nb.comm.protocol import Comm
from mpi4dl_nb.infer.execute import run_infer
from mpi4dl_nb.run.evaluate_run import run_evaluation
from mpi4dl_nb.run.job_run import build_trainer, set_up_run
from tests.support.checks import Checks, run_checks
from tests.support.models import small_resnet
from tests.support.scratch import shared_temp_folder
from tests.support.serial_training import matches_one_process, train_one_process

STEPS = 2
TOLERANCE = 1e-9
EVALUATED = 4   # samples each evaluation reads
MODELS: dict[str, str] = {
    "resnet": "--model resnet --num-layers 8 --num-filters 4 --image-size 32",
    "swin": "--model timm:swin_tiny_patch4_window7_224 --model-args depths=(1,1,1,1),embed_dim=8,"
            "num_heads=(1,1,1,1),window_size=4 --image-size 64",
}
LAYOUTS: dict[str, str] = {
    "2 tiles": "--split-size 1 --spatial-size 1 --num-spatial-parts 2 --slice-method vertical",
    "4 tiles": "--split-size 1 --spatial-size 1 --num-spatial-parts 4",
    "two spatial stages": "--split-size 2 --spatial-size 2 --num-spatial-parts 2 --slice-method vertical",
}
PAIRED = ("resnet", "swin")     # on 2 tiles: ranks 0-1 and 2-3, at once
# on all 4 ranks (ResNet on 4 tiles: check_gradients)
WHOLE = (("swin", "4 tiles"), ("resnet", "two spatial stages"))
FLAGS = ["--num-classes", "3", "--batch-size", "2", "--num-samples", "8", "--dtype", "float64", "--steps",
         str(STEPS), "--optimizer", "adamw", "--no-progress", "--step-timeout", "0"]
GRADIENTS = "python: every gradient equals one process"
INFERRED = "resnet on 2 tiles: infer on the tiles equals one process"


def case_name(model: str, layout: str) -> str:
    return f"{model} on {layout}"


def trained_name(model: str, layout: str) -> str:
    return f"{case_name(model, layout)}: train equals one process"


def evaluated_name(model: str, layout: str) -> str:
    return f"{case_name(model, layout)}: evaluate equals one process"


def check_names() -> list[str]:
    cases = [(model, "2 tiles") for model in PAIRED] + list(WHOLE)
    return [name for model, layout in cases for name in (trained_name(model, layout), evaluated_name(model, layout))
            ] + [INFERRED, GRADIENTS]


def train_and_evaluate(check: Checks, ctx: Comm, model: str, layout: str, folder: Path,
                       alone: dict[str, float]) -> None:
    """One run of ``model`` on ``layout`` against one process, then ``evaluate`` of its checkpoint on the layout; its
    loss equals the one-process evaluation of ``model`` (every layout trains the same weights), which the first run of
    ``model`` makes (rank 0 alone) and keeps in ``alone``."""
    saved = folder / f"{model}-{layout.replace(' ', '-')}"
    argv = [*MODELS[model].split(), *LAYOUTS[layout].split(), *FLAGS, "--checkpoint-dir", str(saved)]
    setup = set_up_run(train_plan(train_parser().parse_args(argv)), ctx)   # the ranks of ctx, not the launch's
    trainer = build_trainer(setup, None)
    summary = trainer.run()
    state = trainer.engine.full_state_dict()
    with check(trained_name(model, layout)) as result:
        cfg = trainer.engine.cfg
        assert cfg.world_size == ctx.world_size == cfg.num_spatial_parts * cfg.split_size, "a rank besides the tiles"
        if ctx.rank == 0:
            assert summary is not None and state is not None
            torch.manual_seed(setup.job.training.seed)
            serial_model = nn.Sequential(*setup.record.model.build(setup.job.data.image_size)).to(torch.float64)
            loss = setup.record.loss()
            assert isinstance(loss, nn.Module)        # a classifier's cross-entropy
            serial = train_one_process(setup, serial_model, loss,
                                       lambda batcher, epoch, step: batcher.labels(epoch, step), STEPS)
            result.detail = matches_one_process(summary.losses, state, serial, serial_model, TOLERANCE)
    ctx.barrier()          # the checkpoint written before any rank looks for it
    with check(evaluated_name(model, layout)) as result:
        tiles = evaluated(["--checkpoint", str(saved), *LAYOUTS[layout].split()], ctx)
        if ctx.rank == 0:
            if model not in alone:
                from mpi4py import MPI

                one = evaluated(["--checkpoint", str(saved), "--split-size", "1", "--spatial-size", "0"],
                                dl.Context(comm=MPI.COMM_SELF))
                assert one["world_size"] == 1 and one["count"] == EVALUATED and isinstance(one["loss"], float), one
                alone[model] = one["loss"]
            assert tiles["world_size"] == ctx.world_size and tiles["count"] == EVALUATED, tiles
            assert isinstance(tiles["loss"], float) and abs(tiles["loss"] - alone[model]) < TOLERANCE, \
                (tiles["loss"], alone[model])
            result.detail = f"loss {tiles['loss']:.9f}, one process {alone[model]:.9f}"


def check_infer(check: Checks, ctx: Comm, folder: Path) -> None:
    """``infer`` of the ResNet checkpoint trained on 2 tiles, tile-level (``--map-mode tiles``) and fully convolutional
    (``dense``), on the pair's 2 tiles and in one process (rank 0 alone): the same probabilities."""
    with check(INFERRED) as result:
        slide = folder / "slide.png"
        if ctx.rank == 0:
            pixels = np.random.default_rng(5).integers(0, 256, (48, 80, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(slide)
        ctx.barrier()
        worst = 0.0
        for mode in ("tiles", "dense"):
            flags = ["--checkpoint", str(folder / "resnet-2-tiles"), "--slide", str(slide), "--map-mode", mode]
            tiles, alone = folder / f"{mode}-tiles.npy", folder / f"{mode}-alone.npy"
            run_infer(parse_job([*flags, "--output", str(tiles), *LAYOUTS["2 tiles"].split()[4:]]).check(), ctx)
            if ctx.rank == 0:
                from mpi4py import MPI

                run_infer(parse_job([*flags, "--output", str(alone), "--num-spatial-parts", "1"]).check(),
                          dl.Context(comm=MPI.COMM_SELF))
                got, want = np.load(tiles), np.load(alone)
                assert got.shape == want.shape and got.size, (got.shape, want.shape)
                worst = max(worst, float(np.abs(got - want).max()))
        assert worst < 1e-5, worst      # float32 maps (the run's dtype is the checkpoint's)
        result.detail = f"maps tiles and dense, max difference {worst:.1e}"


def evaluated(flags: list[str], ctx: Comm) -> dict[str, object]:
    """``evaluate flags`` on ``EVALUATED`` samples: its summary's figures on rank 0 (empty elsewhere)."""
    plan = evaluate_plan(evaluate_parser().parse_args([*flags, "--num-samples", str(EVALUATED)]))
    summary = run_evaluation(plan, ctx)
    return summary.as_dict() if summary is not None else {}


def check_gradients(check: Checks, ctx: Comm) -> None:
    """``nn.CrossEntropyLoss`` on 4 tiles, no optimizer: every rank's gradients equal one process's."""
    with check(GRADIENTS) as result:
        cfg = dl.ParallelConfig(split_size=1, spatial_size=1, num_spatial_parts=ctx.world_size)
        gen = torch.Generator().manual_seed(7)
        images = torch.randn(4, 3, 32, 32, generator=gen, dtype=torch.float64)
        labels = torch.randint(0, 5, (4,), generator=gen)
        engine = dl.HybridEngine([layer.double() for layer in small_resnet()], cfg, ctx,
                                 loss_fn=nn.CrossEntropyLoss())
        loss = engine.train_step(images, labels)
        serial = nn.Sequential(*[layer.double() for layer in small_resnet()])
        want = nn.CrossEntropyLoss()(serial(images), labels)
        want.backward()
        assert abs(loss - want.item()) < 1e-12, (loss, want.item())
        (inst,) = engine.instances.values()
        got = {inst.canonical.full_key(name): p for name, p in inst.canonical.named_parameters()}
        worst = 0.0
        for name, p in serial.named_parameters():
            mine = got[name].grad
            assert mine is not None and p.grad is not None, name
            error = (mine - p.grad).abs().max().item() / p.grad.abs().max().item()
            assert error < 1e-10, f"rank {ctx.rank} {name}: relative error {error:.1e}"
            worst = max(worst, error)
        buffers = {inst.canonical.full_key(name): b for name, b in inst.canonical.named_buffers()}
        for name, b in serial.named_buffers():
            assert torch.allclose(buffers[name], b, rtol=1e-12, atol=1e-14), f"rank {ctx.rank} {name}"
        result.detail = f"loss {loss:.9f}, worst relative gradient error {worst:.1e}, BatchNorm statistics equal"


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    pair = dl.Context(comm=ctx.mpi_comm.Split(ctx.rank // 2, ctx.rank))
    alone: dict[str, float] = {}   # each model's one-process evaluation, on the rank that made it
    with shared_temp_folder(ctx, "joined-head-") as folder:
        train_and_evaluate(check, pair, PAIRED[ctx.rank // 2], "2 tiles", folder, alone)
        if ctx.rank < 2:
            check_infer(check, pair, folder)
        made = ctx.all_gather_object(alone)
        alone = {model: loss for found in made for model, loss in found.items()}
        for model, layout in WHOLE:
            train_and_evaluate(check, ctx, model, layout, folder, alone)
    check_gradients(check, ctx)


if __name__ == "__main__":
    run_checks(main)
