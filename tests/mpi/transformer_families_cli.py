"""MPI (5 ranks): timm's Swin, MaxViT and EfficientViT set up from the command line train on 2x2 tiles + a layer rank
exactly as one process does, and ``evaluate`` runs on each checkpoint with the same layout (issue 66).

The ranks set the run up as ``python -m mpi4dl_nb train`` does (``parsed_plan``, ``set_up_run``, ``build_trainer``),
3 float64 steps; rank 0 trains the record's model in one process (whole images, the layout's chunks). Models, cut in
depth by ``--model-args`` to stay small, the two built for 224 px at other sizes (``--image-size`` builds them for
it): ``swin_tiny_patch4_window7_224`` at 192 px (one block per stage, 16 wide: the cut Swin's trunk on the tiles, its
classifier on the layer rank; its 48, 24, 12 and 6 token grids padded to whole 7 x 7 windows, as one process pads),
``maxvit_tiny_rw_224`` at 160 px (one block per stage, 5 x 5 windows and grids), ``efficientvit_b0`` at 128 px (its
LiteMLA in float64 on both sides: ``models/external.float64_kept``).

Checks, per model: ``<model>: train on tiles equals one process`` (losses and every weight within 1e-9);
``<model>: evaluate on tiles`` (``python -m mpi4dl_nb evaluate``'s plan and run on the checkpoint, 5 ranks; rank 0
writes the summary to ``FOLDER/<model>.json`` for the test to compare with a one-process evaluation).

Usage: python -m tests.mpi.transformer_families_cli FOLDER   (5 ranks; checkpoints under FOLDER/<model>/)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import mpi4dl_nb as dl
from mpi4dl_nb.cli.evaluate_cmd import evaluate_parser, evaluate_plan
from mpi4dl_nb.cli.train_cmd import parsed_plan
from mpi4dl_nb.comm.protocol import Comm
from mpi4dl_nb.run.evaluate_run import run_evaluation
from mpi4dl_nb.run.job_run import build_trainer, set_up_run
from tests.support.checks import Checks, run_checks
from tests.support.serial_training import matches_one_process, train_one_process

STEPS = 3
TOLERANCE = 1e-9
MODELS: dict[str, str] = {
    "swin": "--model timm:swin_tiny_patch4_window7_224 --model-args depths=(1,1,1,1),embed_dim=16,"
            "num_heads=(1,1,1,1) --image-size 192",
    "maxvit": "--model timm:maxvit_tiny_rw_224 --model-args depths=(1,1,1,1),embed_dim=(32,32,64,64),stem_width=16 "
              "--image-size 160",
    "efficientvit": "--model timm:efficientvit_b0 --image-size 128",
}
LAYOUT = "--split-size 2 --spatial-size 1 --num-spatial-parts 4".split()
FLAGS = ["--num-classes", "2", "--batch-size", "2", "--num-samples", "8", "--dtype", "float64", "--steps",
         str(STEPS), "--no-progress", "--step-timeout", "0", *LAYOUT]


def train_and_evaluate(check: Checks, ctx: Comm, label: str, folder: Path) -> None:
    """One model's run on the layout against one process, then ``evaluate`` on its checkpoint."""
    argv = [*MODELS[label].split(), *FLAGS, "--checkpoint-dir", str(folder / label)]
    setup = set_up_run(parsed_plan(argv), ctx)
    trainer = build_trainer(setup, None)
    summary = trainer.run()
    state = trainer.engine.full_state_dict()
    with check(f"{label}: train on tiles equals one process") as result:
        if ctx.rank == 0:
            assert summary is not None and state is not None
            torch.manual_seed(setup.job.training.seed)
            model = torch.nn.Sequential(*setup.record.model.build(setup.job.data.image_size)).to(torch.float64)
            loss = setup.record.loss()
            assert isinstance(loss, torch.nn.Module)        # a classifier's cross-entropy
            serial = train_one_process(setup, model, loss, lambda batcher, epoch, step: batcher.labels(epoch, step),
                                       STEPS)
            result.detail = matches_one_process(summary.losses, state, serial, model, TOLERANCE)
    ctx.barrier()          # the checkpoint written before any rank looks for it
    with check(f"{label}: evaluate on tiles") as result:
        args = evaluate_parser().parse_args(["--checkpoint", str(folder / label), *LAYOUT, "--num-samples", "4"])
        evaluated = run_evaluation(evaluate_plan(args), ctx)
        if ctx.rank == 0:
            assert evaluated is not None
            (folder / f"{label}.json").write_text(evaluated.to_json())
            result.detail = evaluated.to_json()[:120]


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    folder = Path(sys.argv[1])
    for label in MODELS:
        train_and_evaluate(check, ctx, label, folder)


if __name__ == "__main__":
    run_checks(main)
