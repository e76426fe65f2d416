"""A full training step (forward, backward, gradient reduction, AdamW's step) on 1x2 tiles against one process.

    python benchmarks/bench_full_step.py                      # Swin-T 448 px and ViT-S/16 768 px, stages 0-3
    python benchmarks/bench_full_step.py --models swin --stages 0,2 --runs 3

Every figure is the ``train`` command's own (its JSON summary): seconds per timed step = 1 / ``images_per_s``
(batch 1), which leaves out the ``untimed_steps`` (the first step: the op guard's checks, first touches).
One process: ``mpiexec -n 1 ... train --split-size 1
--spatial-size 0``; the tiles: ``mpiexec -n 2 ... train --split-size 1 --spatial-size 1 --num-spatial-parts 2
--slice-method vertical --zero-stage Z`` (the joined head on the tile ranks: no third rank). float32, batch 1,
synthetic images, AdamW. The variants run in turns (one process, then each stage), ``--runs`` turns; a variant's
figure is the median over its turns with the spread. Speed-up = one process's seconds per step over the tiles'
(ceiling 2). ``state_bytes``: what a tile rank keeps between steps (weights, gradients, optimizer state).

Beside it, the same run measures forward + backward alone (``bench_transformer_tiles.py --serial-threads 1
--no-profile``, one turn of 3 steps per model and run): the machine's own speed-up of the tiles' compute, against
which the full step is read (issue 80: the full step reaches at least that, or 1.85x).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from dataclasses import dataclass

from support.launch import last_json, run_job
from support.machine import REPO, Footer
from support.tables import Table


@dataclass(frozen=True)
class Model:
    title: str
    argv: tuple[str, ...]
    tiles_name: str           # its name in bench_transformer_tiles.py


MODELS = {
    "swin": Model("Swin-T, 448 px", ("--model", "timm:swin_tiny_patch4_window7_224", "--image-size", "448"), "swin"),
    "vit": Model("ViT-S/16, 4 blocks, 768 px", ("--model", "timm:vit_small_patch16_224", "--model-args", "depth=4",
                                                "--image-size", "768"), "vit"),
}
COMMON = ("--batch-size", "1", "--num-classes", "2", "--optimizer", "adamw", "--lr", "1e-4", "--no-progress",
          "--dtype", "float32")


def step_seconds(summary: dict) -> float:
    """Seconds per timed step of a train summary: its ``images_per_s`` counts the steps after the
    ``untimed_steps`` (the first, with the op guard's checks and the first touch of every buffer), batch 1."""
    return 1.0 / float(summary["images_per_s"])


def train(model: Model, ranks: int, stage: int | None, steps: int) -> dict:
    """One ``train`` run's JSON summary (``stage`` None: one process)."""
    layout = (("--split-size", "1", "--spatial-size", "0") if stage is None else
              ("--split-size", "1", "--spatial-size", "1", "--num-spatial-parts", "2", "--slice-method", "vertical",
               "--zero-stage", str(stage)))
    with tempfile.TemporaryDirectory() as scratch:   # whatever the run writes (logs) goes there
        argv = [sys.executable, "-m", "mpi4dl_nb", "train", *model.argv, *COMMON, *layout, "--steps", str(steps)]
        return last_json(run_job(ranks, argv, cwd=scratch).stdout)


def forward_backward_speedup(model: Model) -> float:
    """bench_transformer_tiles.py's speed-up of forward + backward (one turn of 3 steps)."""
    argv = [sys.executable, str(REPO / "benchmarks" / "bench_transformer_tiles.py"), "--models", model.tiles_name,
            "--serial-threads", "1", "--no-profile", "--turns", "1", "--steps", "3", "--wait", "block"]
    text = run_job(2, argv, cwd=str(REPO / "benchmarks")).stdout
    found = re.findall(r"(\d+\.\d+)x", text)
    if not found:
        raise RuntimeError(f"no speed-up in bench_transformer_tiles.py's output:\n{text[-2000:]}")
    return float(found[0])


def spread(values: list[float], unit: str = "") -> str:
    return f"{statistics.median(values):.3f}{unit} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="swin,vit", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--stages", default="0,1,2,3", help="ZeRO stages of the tiles, comma-separated")
    parser.add_argument("--runs", type=int, default=3, help="turns of every variant")
    parser.add_argument("--steps", type=int, default=5, help="steps per run (the first untimed)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    footer = Footer()
    stages = [int(s) for s in args.stages.split(",") if s]
    table = Table(["model", "variant", ">s/step median (spread)", ">speed-up median (spread)",
                   ">tile state MB", ">fwd+bwd speed-up (runs)"])
    for name in args.models.split(","):
        model = MODELS[name]
        seconds: dict[str, list[float]] = {}
        state: dict[str, int] = {}
        plain: list[float] = []
        for turn in range(args.runs):
            for stage in [None, *stages]:
                label = "one process" if stage is None else f"1x2 tiles, --zero-stage {stage}"
                summary = train(model, 1 if stage is None else 2, stage, args.steps)
                seconds.setdefault(label, []).append(step_seconds(summary))
                state[label] = max(int(b) for b in summary["state_bytes"])
                print(f"{model.title} turn {turn + 1}: {label}: {seconds[label][-1]:.3f} s/step", flush=True)
            plain.append(forward_backward_speedup(model))
            print(f"{model.title} turn {turn + 1}: forward + backward speed-up {plain[-1]:.2f}x", flush=True)
        serial = seconds["one process"]
        for label, values in seconds.items():
            ratios = [s / v for s, v in zip(serial, values)]
            table.add(model.title, label, spread(values), "" if label == "one process" else spread(ratios, "x"),
                      f"{state[label] / 2**20:.1f}", " / ".join(f"{p:.2f}x" for p in plain))
    print(table.text(args.markdown))
    footer.print()


if __name__ == "__main__":
    main()
