"""MPI (5 ranks): timm's Swin, MaxViT and EfficientViT set up from the command line train on 2x2 tiles + a layer rank
exactly as one process does, and ``evaluate`` runs on each checkpoint with the same layout (issue 66).

The ranks set the run up as ``python -m mpi4dl_nb train`` does (``parsed_plan``, ``set_up_run``, ``build_trainer``),
2 float64 steps (the second from the first's updated weights and momentum); rank 0 trains the record's model in one
process (whole images, the layout's chunks). Models, cut in depth by ``--model-args`` to stay small, the two built
for 224 px at other sizes (``--image-size`` builds them for it): ``swin_tiny_patch4_window7_224`` at 192 px (one
block per stage, 16 wide: the cut Swin's embedding and stages on the tiles, its head on the layer rank, its
stochastic depth on one stage; its 48, 24, 12 and 6 token grids padded to whole 7 x 7 windows, as one process pads),
``maxvit_tiny_rw_224`` at 160 px (one block per stage, 5 x 5 windows and grids), ``efficientvit_b0`` at 128 px (its
LiteMLA in float64 on both sides: its family's ``float64_patch``).

Checks, per model: ``<model>: train on tiles equals one process`` (losses and every weight within 1e-9);
``<model>: evaluate on tiles`` (``python -m mpi4dl_nb evaluate``'s plan and run on the checkpoint, 4 samples on the 5
ranks); then ``swin: evaluate in one process equals the tiles`` (rank 0 evaluates the Swin checkpoint alone, a
context of its own communicator: the same loss within 1e-9). A job of the shared 5-rank launch (its checkpoints in a
scratch folder rank 0 removes at its end).

Usage: python -m tests.mpi.transformer_families_cli   (5 ranks)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import mpi4dl_nb as dl
from mpi4dl_nb.cli.evaluate_cmd import evaluate_parser, evaluate_plan
from mpi4dl_nb.cli.train_cmd import parsed_plan
from mpi4dl_nb.comm.protocol import Comm
from mpi4dl_nb.run.evaluate_run import run_evaluation
from mpi4dl_nb.run.job_run import build_trainer, set_up_run
from tests.support.checks import Checks, run_checks
from tests.support.scratch import shared_temp_folder
from tests.support.serial_training import classifier_matches_one_process

STEPS = 2
TOLERANCE = 1e-9
EVALUATED = 4   # samples each evaluation reads
Figures = dict[str, object]   # an evaluation summary's figures (its JSON)
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


def train_and_evaluate(check: Checks, ctx: Comm, label: str, folder: Path, summaries: dict[str, Figures]) -> None:
    """One model's run on the layout against one process, then ``evaluate`` on its checkpoint (its figures kept in
    ``summaries`` on rank 0)."""
    argv = [*MODELS[label].split(), *FLAGS, "--checkpoint-dir", str(folder / label)]
    setup = set_up_run(parsed_plan(argv), ctx)
    trainer = build_trainer(setup, None)
    summary = trainer.run()
    state = trainer.engine.full_state_dict()
    with check(trained_name(label)) as result:
        if ctx.rank == 0:
            assert summary is not None and state is not None
            result.detail = classifier_matches_one_process(setup, summary.losses, state, STEPS, TOLERANCE)
    ctx.barrier()          # the checkpoint written before any rank looks for it
    with check(evaluated_name(label)) as result:
        figures = evaluated(["--checkpoint", str(folder / label), *LAYOUT], ctx)
        if ctx.rank == 0:
            assert figures["world_size"] == 5 and figures["count"] == EVALUATED, figures
            summaries[label] = figures
            result.detail = json.dumps(figures)[:120]


def evaluated(flags: list[str], ctx: Comm) -> Figures:
    """``evaluate flags`` on ``EVALUATED`` samples: its summary's figures on rank 0 (empty elsewhere)."""
    summary = run_evaluation(evaluate_plan(evaluate_parser().parse_args([*flags, "--num-samples", str(EVALUATED)])),
                             ctx)
    return summary.as_dict() if summary is not None else {}


def trained_name(label: str) -> str:
    return f"{label}: train on tiles equals one process"


def evaluated_name(label: str) -> str:
    return f"{label}: evaluate on tiles"


ONE_PROCESS = "swin: evaluate in one process equals the tiles"


def check_names() -> list[str]:
    return [name for label in MODELS for name in (trained_name(label), evaluated_name(label))] + [ONE_PROCESS]


def main(check: Checks) -> None:
    from mpi4py import MPI

    torch.set_num_threads(1)
    ctx = dl.init()
    summaries: dict[str, Figures] = {}
    with shared_temp_folder(ctx, "families-cli-") as folder:
        for label in MODELS:
            train_and_evaluate(check, ctx, label, folder, summaries)
        with check(ONE_PROCESS) as result:
            if ctx.rank == 0:    # alone: a context of its own communicator
                one = evaluated(["--checkpoint", str(folder / "swin"), "--split-size", "1", "--spatial-size", "0"],
                                dl.Context(comm=MPI.COMM_SELF))
                tiles = summaries["swin"]
                assert one["world_size"] == 1 and one["count"] == EVALUATED, one
                assert isinstance(one["loss"], float) and isinstance(tiles["loss"], float), (one, tiles)
                assert abs(one["loss"] - tiles["loss"]) < TOLERANCE, (one["loss"], tiles["loss"])
                result.detail = f"loss {one['loss']:.9f}, on the tiles {tiles['loss']:.9f}"


if __name__ == "__main__":
    run_checks(main)
