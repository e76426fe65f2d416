"""Per-rank peak memory of ``infer`` at a fixed window as the slide grows 6x, classifier and segmentation side by side.

For each network, ``python -m mpi4dl_nb infer`` on RANKS ranks (one window split over them), the same
``--window`` and outputs (.npy, slide-aligned .tif, and .csv for the classifier / .geojson for the
U-Net), on a SIDE x SIDE synthetic slide and one sqrt(6) times larger per side; a warm-up run first.
Prints every rank's peak (heap bytes in use above the loop's start, writers on rank 0 included: the
summary's ``peak_memory_bytes``) and the ratio large / small per rank: the goal is at most 1.3x.

    python benchmarks/bench_infer_memory.py --side 1024 --window 256 --ranks 4 --dtype float64
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from bench_infer import make_checkpoint, synthetic_slide
from support.launch import run_job
from support.machine import REPO, Footer
from support.tables import Table


def unet_checkpoint(folder: Path, dtype: str) -> Path:
    """A U-Net (depth 2, width 8, 3 classes; BatchNorm statistics drawn, weights seeded) written as train writes."""
    if list(folder.glob("step-*.pt")):
        return folder
    import torch

    from mpi4dl_nb.checkpoint.record import DataRecord, RunRecord, write_checkpoint
    from mpi4dl_nb.data.apps import AppKind
    from mpi4dl_nb.data.task import Task
    from mpi4dl_nb.models.spec import ModelSpec

    spec = ModelSpec.of("unet", num_layers=2, num_filters=8, num_classes=3)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*spec.build(64))
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.2, 0.2)
            module.running_var.uniform_(0.5, 1.5)
    record = RunRecord(spec, DataRecord(AppKind.MEDICAL, 64, 2, dtype, classes=("background", "tumor", "stroma")),
                       task=Task.SEGMENTATION)
    write_checkpoint(folder, record.at(1, "0badc0ffee00"), model.state_dict(), None)
    return folder


def peaks(ranks: int, checkpoint: Path, slide: Path, outputs: list[Path], window: int, dtype: str) -> list[int]:
    method = "square" if math.isqrt(ranks) ** 2 == ranks else "vertical"
    argv = [sys.executable, "-m", "mpi4dl_nb", "infer", "--checkpoint", str(checkpoint), "--slide", str(slide),
            *(x for o in outputs for x in ("--output", str(o))), "--num-spatial-parts", str(ranks),
            "--slice-method", method, "--window", str(window), "--dtype", dtype, "--overwrite", "--no-progress"]
    summary = json.loads(run_job(ranks, argv).stdout.strip().splitlines()[-1])
    return [int(b) for b in summary["peak_memory_bytes"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=1024, help="side of the small slide (pixels)")
    parser.add_argument("--window", type=int, default=256, help="--window of every run")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--dtype", default="float64", choices=("float32", "float64"))
    parser.add_argument("--workdir", type=Path, default=REPO / "out" / "bench_infer_memory")
    args = parser.parse_args()
    footer = Footer()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    large_side = round(args.side * math.sqrt(6))
    slides = {}
    for side in (args.side, large_side):
        slides[side] = work / f"synthetic-{side}.tif"
        if not slides[side].exists():
            synthetic_slide(slides[side], side)
    networks = {"classifier (resnet v1 8 x 8, 64 px)": (make_checkpoint(work / "ck", env), ("npy", "tif", "csv")),
                "segmentation (U-Net depth 2 x 8)": (unet_checkpoint(work / "unet", args.dtype),
                                                     ("npy", "tif", "geojson"))}
    print(f"{args.ranks} ranks, --window {args.window}, {args.dtype}; slides {args.side}^2 and {large_side}^2 px "
          f"({large_side ** 2 / args.side ** 2:.1f}x the pixels)\n")
    table = Table(["network", "outputs", "peak MB per rank, small slide", "peak MB per rank, 6x slide",
                   ">largest ratio (goal <= 1.3)"])
    for name, (checkpoint, kinds) in networks.items():
        found = {}
        for label, side in (("warm-up", args.side), ("small", args.side), ("large", large_side)):
            outputs = [work / f"{label}-{checkpoint.name}.{kind}" for kind in kinds]
            found[label] = peaks(args.ranks, checkpoint, slides[side], outputs, args.window, args.dtype)
        ratio = max(b / max(a, 1) for a, b in zip(found["small"], found["large"]))
        table.add(name, " ".join(f".{k}" for k in kinds), " / ".join(f"{b / 2**20:.1f}" for b in found["small"]),
                  " / ".join(f"{b / 2**20:.1f}" for b in found["large"]), f"{ratio:.2f}x")
    print(table.markdown())
    footer.print()


if __name__ == "__main__":
    main()
