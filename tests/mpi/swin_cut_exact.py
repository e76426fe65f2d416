"""MPI (6 ranks): timm's Swin cut at its stages trains on 2x2 tiles + 2 layer ranks exactly as one process does
(issue 81): ``--split-size 3 --spatial-size 1 --num-spatial-parts 4``, set up from the command line's flags.

The ranks set the run up as ``python -m mpi4dl_nb train`` does (``parsed_plan``, ``set_up_run``, ``build_trainer``),
3 float64 steps of a tiny Swin (2, 2, 1, 1 blocks, 8 wide, 4x4 windows: the first two stages' second blocks shifted)
at 64 px; the default cut puts its embedding and first stages on the tiles (their token boxes joined for the first
layer rank: ``pipeline/handoff.GridTokenTiling``) and the later stages and the head on the layer ranks. Rank 0 trains
the record's model in one process (whole images, the layout's chunks). Checks: ``the cut places stages on the layer
ranks`` (the balance the engine trains with) and ``train on tiles equals one process`` (losses and every weight
within 1e-9). A job of the shared 6-rank launch.

Usage: python -m tests.mpi.swin_cut_exact   (6 ranks)
"""

from __future__ import annotations

import torch

import mpi4dl_nb as dl
from mpi4dl_nb.cli.train_cmd import parsed_plan
from mpi4dl_nb.models.swin import SwinStagePiece
from mpi4dl_nb.run.job_run import build_trainer, set_up_run
from tests.support.checks import Checks, run_checks
from tests.support.serial_training import classifier_matches_one_process

STEPS = 3
TOLERANCE = 1e-9
MODEL = ["--model", "timm:swin_tiny_patch4_window7_224", "--model-args",
         "depths=(2,2,1,1),embed_dim=8,num_heads=(1,1,1,1),window_size=4,drop_path_rate=0.0", "--image-size", "64"]
LAYOUT = "--split-size 3 --spatial-size 1 --num-spatial-parts 4".split()
FLAGS = ["--num-classes", "2", "--batch-size", "2", "--num-samples", "4", "--dtype", "float64", "--steps",
         str(STEPS), "--no-progress", "--step-timeout", "0", *LAYOUT]
PLACED = "the cut places stages on the layer ranks"
TRAINED = "train on tiles equals one process"


def check_names() -> list[str]:
    return [PLACED, TRAINED]


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    setup = set_up_run(parsed_plan([*MODEL, *FLAGS]), ctx)
    trainer = build_trainer(setup, None)
    with check(PLACED) as result:
        balance, stages = trainer.engine.balance, trainer.engine.stages
        assert len(balance) == 3 and isinstance(stages[1][0], SwinStagePiece), balance     # a stage on layer rank 4
        result.detail = f"balance {','.join(map(str, balance))}"
    summary = trainer.run()
    state = trainer.engine.full_state_dict()
    with check(TRAINED) as result:
        if ctx.rank == 0:
            assert summary is not None and state is not None
            result.detail = classifier_matches_one_process(setup, summary.losses, state, STEPS, TOLERANCE)


if __name__ == "__main__":
    run_checks(main)
