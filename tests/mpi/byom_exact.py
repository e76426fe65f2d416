"""MPI (5 ranks): your own model through ``train``: a torchvision ResNet-18 from a weights file of another number
of classes, SP 2x2 + LP in float64, equals one process, and its checkpoint gives the model's own state dict; then
the script of docs/your-own-model.md runs as written there (small: ``--steps 2 --image-size 64``) and ends with
a slide map; then a timm ViT-Tiny from a 224-px timm state dict at 32 px (position embeddings resampled, the
1000-class head replaced) on 5 pipeline stages, with recomputation, and fine-tuned in its last blocks under zero
bubble (frozen weights unchanged), and at 64 px (4x4 tokens) with its embedding and first blocks on 4 token tiles
handing their tokens to a layer rank (the ViT spatial stage of ``train --model timm:vit_small_patch16_224 --image-size
448 --split-size 2 --spatial-size 1 --num-spatial-parts 4``, which is too heavy for the suite), and the same for an
EVA-02-Tiny built from the seed (no weights: its rotary embedding sliced per tile) at 56 px, its blocks recomputed
under 1F1B, each equal to one process.

The ranks set the run up as ``python -m mpi4dl_nb train`` does (``parsed_plan``, then ``set_up_run``,
``build_trainer`` of run/job_run.py) from ``--model torchvision:resnet18 --weights W.pth --num-classes 2`` (W.pth: a
1000-class state dict rank 0 writes first); rank 0 trains the same model in one process (the flags' spec, the weights
loaded by the original keys, ImageNet normalisation, the same optimizer and batches); ``dl.model_state_dict`` of the
checkpoint loads into ``torchvision.models.resnet18(num_classes=2)`` strictly. ``evaluate`` and ``infer`` on such a
checkpoint without model flags: tests/cli/test_byom_cli.py (one process) and the docs script (5 ranks, a model
object). The acceptance command itself (ResNet-50, 256 px, batch 32) is too heavy for the suite: run by hand
(docs/your-own-model.md).
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import numpy as np
import torch

import mpi4dl_nb as dl
from mpi4dl_nb.cli.train_cmd import parsed_plan
from mpi4dl_nb.data.dataset import Batcher
from mpi4dl_nb.models.weights import load_weights, read_weights
from mpi4dl_nb.run.job_run import JobSetup, build_trainer, set_up_run
from tests.support.checks import Checks, run_checks
from tests.support.planes import split_backend
from tests.support.scratch import shared_temp_folder
from tests.support.serial_training import matches_one_process, train_one_process

STEPS = 2
SIDE = 64
FLAGS = (f"--model torchvision:resnet18 --num-classes 2 --image-size {SIDE} --batch-size 2 --num-samples 4 "
         f"--dtype float64 --steps {STEPS} --no-progress --step-timeout 0 --lr 0.01").split()
SP_LP = "--split-size 2 --spatial-size 1 --num-spatial-parts 4".split()
TOLERANCE = 1e-9
VIT = ("--model timm:vit_tiny_patch16_224 --num-classes 2 --image-size 32 --batch-size 5 --num-samples 10 --dtype "
       f"float64 --steps {STEPS} --no-progress --step-timeout 0 --lr 0.01 --split-size 5 --spatial-size 0").split()
VIT_RUNS = {   # a ViT from a timm state dict of the 224-px grid (position embeddings resampled) on 5 layer stages
    "a ViT from a timm state dict on 5 pipeline stages (1F1B, recomputed blocks) equals one process":
        "--parts 5 --schedule 1f1b --checkpoint-activations every",
    "a ViT fine-tuned in its last 2 blocks (--train-blocks 2, zero bubble) equals one process, the rest unchanged":
        "--parts 5 --schedule zb1 --train-blocks 2",
    "a ViT's embedding and first 6 blocks on 2x2 token tiles (ring attention), the rest on a layer rank, equals one "
    "process": "--image-size 64 --split-size 2 --spatial-size 1 --num-spatial-parts 4",
    "an EVA-02 (rotary embeddings) without weights, its embedding and first 6 blocks on 2x2 token tiles, recomputed "
    "block by block (1F1B), equals one process": "--model timm:eva02_tiny_patch14_224 --image-size 56 --split-size 2 "
                                                 "--spatial-size 1 --num-spatial-parts 4 --parts 5 --schedule 1f1b "
                                                 "--checkpoint-activations every",
}
CHECKS = ("losses equal one process", "model_state_dict loads into torchvision strictly",
          "the docs script runs as written and ends with a slide map", *VIT_RUNS)
DOC = Path(__file__).resolve().parents[2] / "docs" / "your-own-model.md"
SCRIPT_MARK = "<!-- script: your_own_model.py -->"


def one_process(setup: JobSetup, weights: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The run in one process: the flags' spec, the weights by the model's keys, the optimizer, the batches."""
    torch.manual_seed(setup.job.training.seed)
    layers = setup.record.model.build(setup.job.data.image_size)
    load_weights(layers, read_weights(weights), model=setup.record.model.label)
    model = torch.nn.Sequential(*layers).to(torch.float64)
    losses = train_one_process(setup, model, torch.nn.CrossEntropyLoss(), Batcher.labels, STEPS)
    return losses, model.state_dict()


def vit_matches_one_process(ctx: dl.Context, checkpoint: Path, flags: str, weights: Path) -> str:
    """Train the ViT with ``flags`` (5 ranks; from ``weights`` unless the flags name another model), then on rank 0
    in one process; the detail line."""
    from mpi4dl_nb.models.pieces import original_state_dict
    from mpi4dl_nb.models.vit import train_last_blocks

    start = [] if "--model" in flags.split() else ["--weights", str(weights)]
    setup = set_up_run(parsed_plan([*VIT, *flags.split(), *start, "--checkpoint-dir", str(checkpoint)]), ctx)
    summary = build_trainer(setup, None).run()
    if ctx.rank != 0:
        return ""
    assert summary is not None
    spec = setup.record.model
    torch.manual_seed(setup.job.training.seed)
    layers = spec.build(setup.job.data.image_size)
    if start:
        assert load_weights(layers, read_weights(weights), model=spec.label) is not None    # resampled, head replaced
    if spec.train_blocks is not None:
        train_last_blocks(layers, spec.train_blocks, spec.label)
    model = torch.nn.Sequential(*layers).to(torch.float64)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    serial = train_one_process(setup, model, torch.nn.CrossEntropyLoss(), Batcher.labels, STEPS)
    detail = matches_one_process(summary.losses, dl.model_state_dict(checkpoint), serial,
                                 original_state_dict(layers, model.state_dict()), TOLERANCE)
    frozen = [k for k, p in model.named_parameters() if not p.requires_grad]
    assert (spec.train_blocks is None) == (not frozen), frozen
    assert all(torch.equal(model.state_dict()[k], start[k]) for k in frozen), "a frozen weight changed"
    moved = [k for k, p in model.named_parameters() if p.requires_grad and not torch.equal(p, start[k])]
    assert moved, "nothing trained"
    return f"{detail}; {len(frozen)} frozen tensors unchanged"


def docs_script() -> str:
    """The script of docs/your-own-model.md, as written there."""
    text = DOC.read_text()
    block = text.split(SCRIPT_MARK, 1)[1].split("```python\n", 1)[1]
    return block.split("\n```", 1)[0]


def write_small_data(folder: Path) -> None:
    """Six 64-px tiles per class and a 192x256 slide, cut from the IHC sample (the script's own sample data is
    the whole 512-px image: larger than a test needs)."""
    from PIL import Image

    image = dl.data.ihc_image()
    for name, rows in (("blue", slice(0, 64)), ("brown", slice(448, 512))):
        (folder / "tiles" / name).mkdir(parents=True)
        for index in range(6):
            Image.fromarray(image[rows, index * 64:(index + 1) * 64]).save(folder / "tiles" / name / f"{index}.png")
    Image.fromarray(image[:192, :256]).save(folder / "slide.png")


def run_docs_script(ctx: dl.Context, argv: list[str]) -> list[str]:
    """Run the docs script on every rank with ``argv``; rank 0's printed lines."""
    printed = io.StringIO()
    saved = sys.argv
    sys.argv = ["your_own_model.py", *argv]
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(docs_script(), "your_own_model.py", "exec"), {"__name__": "__main__"})
    finally:
        sys.argv = saved
    ctx.barrier()
    return printed.getvalue().splitlines()


def main(check: Checks) -> None:
    import torchvision


    torch.set_num_threads(1)
    backend, _ = split_backend(sys.argv[1:])
    ctx = dl.init(backend=backend)
    with shared_temp_folder(ctx, "byom-") as folder:
        weights, checkpoint = folder / "W.pth", folder / "ck"
        if ctx.rank == 0:
            torch.manual_seed(1)
            torch.save(torchvision.models.resnet18().state_dict(), weights)   # 1000 classes, as published ones
        ctx.barrier()
        argv = [*FLAGS, *SP_LP, "--weights", str(weights), "--checkpoint-dir", str(checkpoint)]
        plan = parsed_plan(argv)
        setup = set_up_run(plan, ctx)
        summary = build_trainer(setup, None).run()
        with check("losses equal one process") as result:
            if ctx.rank == 0:
                assert summary is not None
                serial, serial_state = one_process(setup, weights)
                parallel = [float(v) for v in summary.losses if v is not None]
                worst = max(abs(a - b) for a, b in zip(parallel, serial))
                assert len(parallel) == STEPS and worst < TOLERANCE, f"losses {parallel} vs one process {serial}"
                result.detail = f"max loss error {worst:.1e}"
                saved = dl.model_state_dict(checkpoint)
                assert max((saved[k[k.index(".") + 1:]] - v).abs().max().item()
                           for k, v in serial_state.items()) < TOLERANCE, "the checkpoint's weights differ"
        with check("model_state_dict loads into torchvision strictly"):
            if ctx.rank == 0:
                model = torchvision.models.resnet18(num_classes=2).double()
                model.load_state_dict(dl.model_state_dict(checkpoint), strict=True)
        with check("the docs script runs as written and ends with a slide map") as result:
            if ctx.rank == 0:
                write_small_data(folder)
            ctx.barrier()
            lines = run_docs_script(ctx, [str(folder / "tiles"), str(folder / "slide.png"), str(folder / "run"),
                                          "--steps", "2", "--image-size", "64"])
            if ctx.rank == 0:
                assert lines[-1].startswith("slide map: [2, "), lines
                assert any(line.startswith("evaluate: 4 held-out tiles") for line in lines), lines
                probabilities = np.load(folder / "run" / "map.npy")
                assert np.allclose(probabilities.sum(axis=0), 1.0) and (folder / "run" / "map.png").is_file()
                result.detail = lines[-1]
        vit_weights = folder / "vit.pth"
        if ctx.rank == 0:
            torch.manual_seed(2)
            torch.save(__import__("timm").create_model("vit_tiny_patch16_224").state_dict(), vit_weights)
        ctx.barrier()
        for index, (name, flags) in enumerate(VIT_RUNS.items()):
            with check(name) as result:
                result.detail = vit_matches_one_process(ctx, folder / f"vit{index}", flags, vit_weights)


if __name__ == "__main__":
    run_checks(main)
