"""MPI (5 ranks): ``train --whole-slide --cohort`` on 4 tiles (2x2) + 1 layer rank equals one process (float64).

Rank 0 writes a synthetic cohort (6 pyramidal slides with MPP, 4 patients, ``data/synthetic_cohort.py``); the ranks
set the run up as ``python -m mpi4dl_nb train`` does (``parsed_plan``, ``set_up_run``,
``build_trainer``) with ``--whole-slide --image-size 64 --mpp 2`` (a ResNet with BatchNorm in the spatial trunk, its
pooled head on the layer rank); rank 0 trains the same model in one process on whole canvases, full batch (one
micro-batch), ``--accumulate N`` as one optimizer step over N batches (``train_one_process``).

Checks: ``canvases read by tile`` (a spatial rank's slide reads are at most its tile, the layer rank reads none);
``... equals one process`` for ``--pool attention`` with 2 micro-steps per optimizer step, tissue-mean (the canvases
carry their tissue mask), ``--slide-encoder transformer`` (2 layers, 4 heads on the 16 channels of the trunk) before
an attention pool, 3 steps, and a ViT trunk (``small_vit``: its patch tokens the grid, models/token_grid.py) with the
encoder before a max pool (losses and final weights, 1e-9); for the ViT case also ``...: train on one process equals
the tiles``: the same command with ``--split-size 1 --spatial-size 0``, run by rank 0 alone (a context on its own
communicator, as ``python -m mpi4dl_nb train`` on one process) has the tiles' losses, and every rank's weights (each
stage it holds) equal its final weights (1e-9), and ``a ViT trunk's slide-level infer on 2x2 tiles equals one
process`` (ranks 0-3; probabilities and both maps, 1e-12); ``patients on one side`` (the split recorded in the
checkpoint keeps each patient's slides on one side); ``canvases recorded``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import mpi4dl_nb as dl
from mpi4dl_nb.checkpoint.record import read_checkpoint
from mpi4dl_nb.cli.train_cmd import train_parser, train_plan
from mpi4dl_nb.data.canvas import SlideCanvases
from mpi4dl_nb.data.dataset import Batcher
from mpi4dl_nb.data.synthetic_cohort import write_synthetic_cohort
from mpi4dl_nb.evaluation.split import Subset
from mpi4dl_nb.run.job_run import JobSetup, build_trainer, set_up_run
from mpi4dl_nb.run.summary import TrainSummary
from tests.mpi.finetune_exact import set_up
from tests.support.checks import Checks, run_checks
from tests.support.scratch import shared_temp_folder
from tests.support.serial_training import matches_one_process, train_one_process
from tests.support.slide_recorder import ReadRecorder

FLAGS = ("--whole-slide --image-size 64 --mpp 2 --batch-size 1 --dtype float64 --val-fraction 0.34 --no-progress "
         "--step-timeout 0 --split-size 2 --spatial-size 1 --num-spatial-parts 4 --slice-method square").split()
CNN = "--model resnet --resnet-version 1 --num-layers 8 --num-filters 4"
ONE_PROCESS = "--split-size 1 --spatial-size 0".split()     # later flags win: the same run, the trunk untiled
ENCODER = "--slide-encoder transformer"
# a ViT trunk (issue 52): ViT-Ti/16 built small for the 64 px canvas (small_vit: 4x4 patch tokens, 2x2 on each
# tile), its embedding and first blocks on the tiles (ring attention), the rest, the token grid and the encoder on the
# layer rank
VIT = f"--model tests.mpi.whole_slide_cli:small_vit {ENCODER}"
TOLERANCE = 1e-9
INFER_TOLERANCE = 1e-12
VIT_INFER = "a ViT trunk's slide-level infer on 2x2 tiles equals one process"


def small_vit(num_classes: int) -> torch.nn.Module:
    """timm's ViT-Ti/16 built small for the 64 px canvas: 2 blocks of width 32 and 2 heads, a class token and a
    register token (both dropped from the slide's token grid); its build and float64 checkpoints stay cheap."""
    import timm

    model: torch.nn.Module = timm.create_model("vit_tiny_patch16_224", img_size=64, depth=2, embed_dim=32,
                                               num_heads=2, reg_tokens=1, num_classes=num_classes)
    return model


@dataclass(frozen=True)
class Case:
    """One training of the launch: ``--pool`` with ``--accumulate``, the trunk and encoder flags (``extra``; the
    ResNet's without ``--model``), its steps, and whether its command is also run on one process by the CLI."""

    pool: str
    accumulate: int
    extra: str = ""
    steps: int = 2
    cli: bool = False

    @property
    def tag(self) -> str:
        return f"{self.pool}-{self.accumulate}" + ("-vit" if "--model" in self.extra else "") + (
            "-encoder" if ENCODER in self.extra else "")


# the slide-level pools (the whole-slide average pool is the plain classifier path the engine battery covers), each
# pool once: accumulation over micro-batches with attention; the slide encoder (models/slide_encoder.py) on the layer
# rank after the ResNet, 3 steps as issue 52's acceptance runs it, and after a ViT with the max pool (the pools run the
# same head code after either trunk); the one-process CLI run of the ViT case
CASES = [Case("attention", 2), Case("tissue-mean", 1), Case("attention", 1, ENCODER, steps=3),
         Case("max", 1, VIT, cli=True)]


def case_label(case: Case) -> str:
    return f"{case.extra} --pool {case.pool}" if case.extra else f"--pool {case.pool} --accumulate {case.accumulate}"


def case_name(case: Case) -> str:
    return f"{case_label(case)} equals one process"


def case_argv(root: Path, case: Case) -> list[str]:
    """``train``'s flags for one case (its own checkpoint folder)."""
    trunk = "" if "--model" in case.extra else CNN
    return [*FLAGS, *trunk.split(), "--pool", case.pool, "--accumulate", str(case.accumulate), "--cohort",
            str(root / "cohort" / "cohort.csv"), "--steps", str(case.steps), *case.extra.split(), "--checkpoint-dir",
            str(root / f"c-{case.tag}")]


def cli_case_name(case: Case) -> str:
    return f"{case_label(case)}: train on one process equals the tiles"


def train_on_one_process(argv: list[str]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``train argv`` on this rank alone (a context of its own communicator): its losses and final weights."""
    from mpi4py import MPI

    plan = train_plan(train_parser().parse_args(argv))    # as the command, without its check of the launched world
    setup = set_up_run(plan, dl.Context(comm=MPI.COMM_SELF))
    trainer = build_trainer(setup, None)
    run = trainer.run()
    state = trainer.engine.full_state_dict()
    assert run is not None and state is not None and setup.job.config.world_size == 1
    return [float(v) for v in run.losses if v is not None], state


def rank_weight_drift(engine: dl.HybridEngine, state: dict[str, torch.Tensor]) -> float:
    """The largest difference of every weight this rank holds (each stage instance) from ``state``'s."""
    drift = 0.0
    for inst in engine.instances.values():
        for key, value in inst.canonical.full_state_dict().items():
            if value.is_floating_point():
                drift = max(drift, (value.double() - state[key].double()).abs().max().item())
    return drift


def check_one_process_cli(check: Checks, ctx: dl.Context, root: Path, case: Case, run: TrainSummary | None,
                          engine: dl.HybridEngine) -> None:
    """The case's command on one process (rank 0) against the tiles' losses and every rank's weights."""
    with check(cli_case_name(case)) as result:
        argv = [*case_argv(root, case), *ONE_PROCESS, "--checkpoint-dir", str(root / f"one-{case.tag}")]
        serial = ctx.bcast_object(train_on_one_process(argv) if ctx.rank == 0 else None, root=0)
        drifts = ctx.all_gather_object(rank_weight_drift(engine, serial[1]))
        if ctx.rank == 0:
            assert run is not None
            losses = [float(v) for v in run.losses if v is not None]
            worst = max(abs(a - b) for a, b in zip(losses, serial[0]))
            assert len(serial[0]) == len(losses) == case.steps and worst < TOLERANCE, f"{losses} vs {serial[0]}"
            result.detail = f"losses {worst:.1e}, weights on ranks 0-{ctx.world_size - 1} {max(drifts):.1e}"
        assert drifts[ctx.rank] < TOLERANCE, f"rank {ctx.rank}'s weights differ by {drifts[ctx.rank]}"


def recorded_reads(setup: JobSetup) -> list[ReadRecorder]:
    """Record every slide read the training canvases make from now on."""
    subset = setup.batcher.dataset if setup.batcher is not None else None
    assert isinstance(subset, Subset) and isinstance(subset.dataset, SlideCanvases)
    canvases = subset.dataset
    canvases.close()
    recorders: list[ReadRecorder] = []

    def recording(path: Path) -> ReadRecorder:
        recorders.append(ReadRecorder.open(path))
        return recorders[-1]

    canvases._opener = recording
    return recorders


def check_reads(check: Checks, ctx: dl.Context, recorders: list[ReadRecorder]) -> None:
    """A spatial rank's slide reads are at most its tile; the layer rank reads none."""
    with check("canvases read by tile") as result:   # 32 px tiles (2x2 of 64), level 1 is 2 µm/px
        reads = [size for recorder in recorders for _, _, size in recorder.calls]
        if ctx.rank < 4:
            assert reads and max(max(s) for s in reads) <= 32, f"rank {ctx.rank} read {sorted(set(reads))}"
        else:
            assert not reads, f"the layer rank read {reads}"
        result.detail = f"{len(reads)} reads, largest {max((max(s) for s in reads), default=0)} px"


def check_vit_infer(check: Checks, ctx: dl.Context, root: Path, case: Case) -> None:
    """Slide-level inference of the ViT case's checkpoint on 2x2 tiles (ranks 0-3: the token tiles joined for the head
    on every rank) against one process on the whole canvas: probabilities, the max pool's map and the class token's
    attention over the 4x4 patch tokens."""
    from mpi4py import MPI

    from mpi4dl_nb.infer.slide_level import open_canvas
    from mpi4dl_nb.infer.slide_list import slide_sources
    from mpi4dl_nb.infer.whole_slide import CanvasNetwork, load_whole_slide
    from mpi4dl_nb.spatial.geometry import TileGrid
    from tests.mpi.whole_slide_infer import class_reference, reference

    group = MPI.COMM_WORLD.Split(0 if ctx.rank < 4 else 1, ctx.rank)
    with check(VIT_INFER) as result:
        if ctx.rank < 4:
            model = load_whole_slide(root / f"c-{case.tag}", torch.float64, check=False)
            network = CanvasNetwork(model, TileGrid(2, 2), dl.Context(comm=group), torch.float64)
            worst = 0.0
            for slide in slide_sources(str(root / "cohort" / "cohort.csv"), model.classes)[:2]:
                canvases = open_canvas(model, slide, 0, 2.0, None)
                prediction = network.predict(canvases, 0)
                if ctx.rank == 0:
                    assert prediction is not None and prediction.cells is not None
                    assert prediction.class_cells is not None and prediction.cells.shape == (4, 4)
                    expected, looked = reference(model, canvases)
                    attended = class_reference(model, canvases)
                    assert looked is not None and attended is not None
                    worst = max(worst, *(float(np.abs(a - b).max()) for a, b in (
                        (prediction.probabilities, expected), (prediction.cells, looked),
                        (prediction.class_cells, attended))))
                canvases.close()
            assert worst < INFER_TOLERANCE, f"tiles and one process differ by {worst}"
            result.detail = f"2 slides, probabilities and both maps within {worst:.1e}" if ctx.rank == 0 else ""
    group.Free()


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    with shared_temp_folder(ctx, "whole-slide-") as folder:
        root = Path(folder)
        if ctx.rank == 0:
            write_synthetic_cohort(root / "cohort", slides=6, side_um=160.0, mpp=1.0, levels=3)
        ctx.barrier()
        summary = None
        for case in CASES:
            setup = set_up(case_argv(root, case), ctx)
            recorders = recorded_reads(setup) if case == CASES[0] else []
            trainer = build_trainer(setup, None)
            run = trainer.run()
            state = trainer.engine.full_state_dict()
            summary = summary or run
            if recorders:
                check_reads(check, ctx, recorders)
            with check(case_name(case)) as result:
                if ctx.rank == 0:
                    assert run is not None and state is not None and setup.batcher is not None
                    assert setup.batcher.dataset.channels == (4 if case.pool == "tissue-mean" else 3)
                    torch.manual_seed(setup.job.training.seed)
                    model = torch.nn.Sequential(*setup.record.model.build(setup.job.data.image_size))
                    model = model.to(torch.float64)
                    assert (setup.record.model.slide_encoder is not None) == (ENCODER in case.extra)
                    serial = train_one_process(setup, model, torch.nn.CrossEntropyLoss(), Batcher.labels, case.steps)
                    result.detail = matches_one_process(run.losses, state, serial, model, TOLERANCE)
            if case.cli:
                check_one_process_cli(check, ctx, root, case, run, trainer.engine)
            if case.extra == VIT:
                check_vit_infer(check, ctx, root, case)
        with check("patients on one side") as result:
            if ctx.rank == 0:
                assert summary is not None and summary.checkpoint is not None
                split = read_checkpoint(summary.checkpoint).record.split
                assert split is not None and split.grouping == "patient"
                assert split.train and split.val and not set(split.train) & set(split.val)
                result.detail = f"train {list(split.train)}, val {list(split.val)}"
        with check("canvases recorded") as result:
            if ctx.rank == 0:
                assert summary is not None and summary.checkpoint is not None
                data = read_checkpoint(summary.checkpoint).record.data
                assert data.whole_slide and [c.slide for c in data.canvases] == [f"slide-{i:02d}" for i in range(6)]
                assert all(c.size == 64 for c in data.canvases)
                result.detail = f"{len(data.canvases)} canvases"


if __name__ == "__main__":
    run_checks(main)
