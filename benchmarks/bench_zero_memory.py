"""Training state per rank under ZeRO (issue 80): measured by real sharded training runs beside the planner's figure,
and the planner's what-fits table of foundation-model ViTs by ZeRO stage, rank count and per-rank budget.

    OMP_NUM_THREADS=1 python benchmarks/bench_zero_memory.py --measure      # BENCHMARKS.md section 18: state points
    python benchmarks/bench_zero_memory.py --fits                            # BENCHMARKS.md section 18: what fits

Measured (``--measure``): ``python -m mpi4dl_nb train`` under ``mpiexec`` (one optimizer step, AdamW, float32,
4 synthetic images a batch) of a depth-cut timm ViT-S/16 (``--model-args depth=D``) on data-parallel copies (1, 2, 4)
and on 1x2 / 2x2 token tiles plus a layer rank, at ``--zero-stage`` 0-3; each rank's ``state_bytes`` from the run's
summary (its parameters, ZeRO's shards, their gradients, buffers and the optimizer's state tensors, each storage
once, after the step). Planner: the same configuration's ``estimate_memory`` (the same layer list, AdamW simulated on
``meta``), each rank's ``state_bytes`` + buffers. Ratios planner / measured, rank by rank, printed side by side.

What fits (``--fits``): the planner's peak of the largest rank for timm's ``vit_huge_patch14_224`` and
``vit_giant_patch14_dinov2`` (built on ``meta`` at the image side, AdamW: 2 states, batch 1, float32) on P = 1, 2 (1x2
tiles), 4 (2x2) and 8 (1x8) ranks at ZeRO 0-3, recomputation off and on (``checkpoint_activations='every'``), and
the lowest ZeRO stage (recomputation off first) whose peak fits 16, 40 and 80 GB. ``--stages 3 --parts 2,4,8``: only
those ZeRO stages and rank counts (the lowest that fits then among them alone).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from support.machine import Footer
from support.tables import Table

from mpi4dl_nb import ParallelConfig, planner
from mpi4dl_nb.config import CheckpointGranularity, SliceMethod
from mpi4dl_nb.models.model_args import parse_model_args
from mpi4dl_nb.run.model_choice import ModelChoice, ModelSizes

REPO = Path(__file__).resolve().parents[1]
MODEL = "timm:vit_small_patch16_224"
GB, MB = 1e9, 2.0 ** 20
BUDGETS_GB = (16, 40, 80)
FOUNDATION = {"H": ("ViT-H/14", "vit_huge_patch14_224"), "g": ("ViT-g/14", "vit_giant_patch14_dinov2")}


@dataclass(frozen=True)
class Run:
    """One measured configuration: its ranks' layout flags, depth of the ViT, image side, ZeRO stage."""

    label: str
    flags: tuple[str, ...]
    depth: int
    side: int
    zero: int

    def config(self) -> ParallelConfig:
        values = dict(zip(self.flags[::2], self.flags[1::2]))
        return ParallelConfig(split_size=int(values["--split-size"]), spatial_size=int(values["--spatial-size"]),
                              num_spatial_parts=int(values.get("--num-spatial-parts", 4)),
                              slice_method=SliceMethod(values.get("--slice-method", "square")),
                              data_parallel=int(values.get("--data-parallel", 1)), zero_stage=self.zero)


DP = ("--split-size", "1", "--spatial-size", "0")
TILES2 = ("--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "2", "--slice-method", "vertical")
TILES4 = ("--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "4", "--slice-method", "square")


def runs() -> list[Run]:
    found = [Run("1 rank", (*DP, "--data-parallel", "1"), 2, 64, 0)]
    for ranks in (2, 4):
        found += [Run(f"DP x{ranks}", (*DP, "--data-parallel", str(ranks)), 2, 64, z) for z in range(4)]
    found += [Run("1x2 tiles + layer rank", TILES2, 2, 64, z) for z in (1, 3)]
    found += [Run("2x2 tiles + layer rank", TILES4, 2, 64, z) for z in (2, 3)]
    return found


def measured(run: Run) -> list[int]:
    """Each rank's state bytes in the summary of ``run`` trained for one step."""
    cfg = run.config()
    command = ["mpiexec", "-n", str(cfg.world_size), sys.executable, "-m", "mpi4dl_nb", "train", "--model", MODEL,
               "--model-args", f"depth={run.depth}", "--image-size", str(run.side), "--num-classes", "3",
               "--batch-size", "4", "--num-samples", "8", "--steps", "1", "--optimizer", "adamw", "--no-progress",
               "--zero-stage", str(run.zero), *run.flags]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [raw for raw in out.stdout.splitlines() if '"state_bytes"' in raw]
    if out.returncode or not lines:
        raise RuntimeError(f"{' '.join(command)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    record = json.loads(lines[-1][lines[-1].index("{"):])
    return [int(b) for b in record["state_bytes"]]


def planned(run: Run) -> list[int]:
    """Each rank's state bytes (+ buffers) in the planner's estimate of ``run``."""
    torch.manual_seed(0)
    spec = ModelChoice(MODEL, parse_model_args(f"depth={run.depth}"), ModelSizes(), normalize="none").spec(3)
    layers = spec.build(run.side)
    plan = planner.estimate_memory(layers, run.config(), run.side, 4,
                                   optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    return [rank.state_bytes + rank.terms["buffers"] for rank in plan.ranks]


def measure_table() -> str:
    table = Table(["configuration", ">ranks", ">ZeRO", ">state MB per rank: measured", ">planner",
                   ">planner/measured (each rank)"])
    for run in runs():
        start = time.perf_counter()
        got, want = measured(run), planned(run)
        ratios = sorted({f"{w / g:.4f}" for g, w in zip(got, want)})
        table.add(run.label, str(len(got)), str(run.zero), " ".join(f"{g / MB:.3f}" for g in got),
                  " ".join(f"{w / MB:.3f}" for w in want), ", ".join(ratios))
        print(table.markdown().splitlines()[-1] + f" <!-- {time.perf_counter() - start:.0f} s -->", flush=True)
    return table.markdown()


def foundation_config(parts: int, zero: int, recompute: bool) -> ParallelConfig:
    method = SliceMethod.SQUARE if parts == 4 else SliceMethod.VERTICAL
    return ParallelConfig(split_size=1, spatial_size=int(parts > 1), num_spatial_parts=max(parts, 2),
                          slice_method=method, zero_stage=zero if parts > 1 else 0,
                          checkpoint_activations=CheckpointGranularity.EVERY if recompute else None)


def foundation_peaks(key: str, side: int, parts: int, stages: tuple[int, ...]) -> dict[tuple[int, bool], float]:
    """The planner's peak (GB) of the largest rank per (ZeRO stage of ``stages``, recomputation)."""
    import timm

    from mpi4dl_nb.models.vit import token_pieces

    with torch.device("meta"):
        model = timm.create_model(FOUNDATION[key][1], img_size=side, num_classes=2, weight_init="skip")
    layers = token_pieces(model)
    return {(zero, recompute): planner.estimate_memory(layers, foundation_config(parts, zero, recompute), side, 1,
                                                       optimizer_states=2).peak / GB
            for zero in stages for recompute in (False, True)}


def lowest_fit(peaks: dict[tuple[int, bool], float], budget: float) -> str:
    for recompute in (False, True):
        for zero in sorted({z for z, _ in peaks}):
            if peaks[(zero, recompute)] <= budget:
                return f"ZeRO {zero}" + (" + recompute" if recompute else "")
    return "none"


def fits_table(stages: tuple[int, ...] = (0, 1, 2, 3), ranks: tuple[int, ...] = (1, 2, 4, 8)) -> str:
    named = " / ".join(map(str, stages))
    table = Table(["model", "image", ">P", f">peak GB, ZeRO {named}, recompute off", ">on",
                   *(f">{b} GB: lowest that fits" for b in BUDGETS_GB)])
    for key in FOUNDATION:
        for side in (1024, 2048):
            for parts in ranks:
                start = time.perf_counter()
                peaks = foundation_peaks(key, side, parts, stages)
                cells = [" / ".join(f"{peaks[(z, r)]:.1f}" for z in stages) for r in (False, True)]
                table.add(FOUNDATION[key][0], f"{side}²", str(parts), *cells,
                          *(lowest_fit(peaks, b) for b in BUDGETS_GB))
                print(table.markdown().splitlines()[-1] + f" <!-- {time.perf_counter() - start:.0f} s -->",
                      flush=True)
    return table.markdown()


def _numbers(text: str) -> tuple[int, ...]:
    return tuple(int(item) for item in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="train the small ViTs and compare state bytes")
    parser.add_argument("--fits", action="store_true", help="the planner's what-fits table of ViT-H/14, ViT-g/14")
    parser.add_argument("--stages", type=_numbers, default=(0, 1, 2, 3), help="--fits: these ZeRO stages (0,1,2,3)")
    parser.add_argument("--parts", type=_numbers, default=(1, 2, 4, 8), help="--fits: these rank counts (1,2,4,8)")
    args = parser.parse_args()
    footer = Footer()
    torch.set_num_threads(1)
    if args.measure:
        print("training state per rank, AdamW, float32 (measured: the run's summary; planner: estimate_memory)")
        print(measure_table(), flush=True)
    if args.fits:
        print("\nthe planner's peak of the largest rank, GB, AdamW, float32, batch 1; the lowest ZeRO stage that fits")
        print(fits_table(args.stages, args.parts), flush=True)
    footer.print()


if __name__ == "__main__":
    main()
