"""What resolution buys: one synthetic cohort trained at four resolutions of the same slides (fixed canvas in µm).

The cohort (``data/synthetic_cohort.py``): pyramidal TIFF slides with MPP, tissue-like stroma and nuclei in both
classes, and in ``positive`` slides a few clusters of dark dots about 2 µm across, which area averaging at
4 µm per pixel blurs into the stroma. Each resolution trains the same network (ResNet v1, ``--pool max`` by
default, batch 1) on the same slides, on a canvas of ``--canvas-um`` µm, so ``--image-size = canvas_um / mpp``:
``train --whole-slide --cohort`` on 2x2 tiles + 1 layer rank (5 processes; one process trains the same to
round-off: tests/mpi/whole_slide_cli.py), held-out slides by patient (the run's ``--val-fraction`` split,
``evaluation/grouped.py``), evaluated once at the end. Then each canvas size's measured peak bytes per rank
of one training step (``support/whole_slide.py``: allocation profiler, fp32, random pixels) on one process and
on the 4 tiles + layer rank.

Printed: mpp, canvas px and Mpx, held-out slide AUC (and patient AUC), peak MiB per rank for 1 and 4 tile ranks;
a figure with ``--figure PNG``. Small by default (24 slides, 48 steps: minutes on 2 cores); ``--slides``,
``--steps``, ``--num-filters`` and ``--seeds`` scale it up. AUC on a few held-out slides is coarse: the table
says how many.

    python benchmarks/bench_resolution.py --figure docs/images/whole_slide_resolution.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from support.launch import last_json, run_job
from support.machine import Footer
from support.tables import Table
from support.whole_slide import MIB, canvas_multiple, layout_name, processes, step_peaks

import mpi4dl_nb as dl
from mpi4dl_nb.data.synthetic_cohort import write_synthetic_cohort
from mpi4dl_nb.models.spec import ModelSpec

TILES = 4
RESNET_STRIDE = 4          # the built-in ResNet down-samples by 4
MEMORY = "resolution-memory:"


@dataclass(frozen=True)
class Network:
    """The network every resolution trains: a built-in ResNet v1 with a slide-level pool, 2 classes."""

    num_layers: int
    num_filters: int
    pool: str

    def flags(self) -> list[str]:
        return ["--model", "resnet", "--resnet-version", "1", "--num-layers", str(self.num_layers),
                "--num-filters", str(self.num_filters), "--pool", self.pool]

    def build(self, side: int) -> list[torch.nn.Module]:
        torch.manual_seed(0)
        spec = ModelSpec.of("resnet", num_layers=self.num_layers, num_filters=self.num_filters, num_classes=2,
                            resnet_version=1, pool=self.pool)
        return spec.build(side)


@dataclass(frozen=True)
class Trained:
    """One training run's held-out figures (None: the run's summary did not carry them)."""

    slide_auc: float | None
    patient_auc: float | None
    held_out: int
    seconds: float


def train(cohort: Path, network: Network, mpp: float, side: int, steps: int, seed: int, args: argparse.Namespace,
          folder: Path) -> Trained:
    """``train --whole-slide`` at ``mpp`` on a ``side`` px canvas (2x2 tiles + 1 layer rank); its held-out AUC."""
    argv = [sys.executable, "-m", "mpi4dl_nb", "train", "--whole-slide", "--cohort", str(cohort),
            "--image-size", str(side), "--mpp", f"{mpp:g}", *network.flags(), "--batch-size", "1",
            "--steps", str(steps), "--eval-every", str(steps), "--val-fraction", f"{args.val_fraction:g}",
            "--optimizer", args.optimizer, "--lr", f"{args.lr:g}", "--seed", str(seed), "--no-progress",
            "--step-timeout", "0", "--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", str(TILES),
            "--slice-method", "square", "--checkpoint-dir", str(folder / f"run-{mpp:g}-{seed}")]
    done = run_job(processes(TILES), argv)
    summary = last_json(done.stdout)
    slide = summary.get("val_roc_auc")   # one sample per slide: the slide AUC
    level = summary.get("val_patient")
    patient = level.get("roc_auc") if isinstance(level, dict) else None
    return Trained(float(slide) if isinstance(slide, (int, float)) else None,
                   float(patient) if isinstance(patient, (int, float)) else None, int(summary.get("val_count", 0)),
                   float(summary.get("seconds", 0.0)))


def figure_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def memory_worker(network: Network, sides: list[int], tiles: int) -> None:
    """Under ``mpiexec``: the measured peak bytes of every rank at each side, one JSON line from rank 0."""
    torch.set_num_threads(1)
    ctx = dl.init()
    peaks = {side: step_peaks(ctx, lambda side=side: network.build(side), tiles, side) for side in sides}
    if ctx.rank == 0:
        print(f"{MEMORY} {json.dumps({str(s): p for s, p in peaks.items()})}", flush=True)
    ctx.barrier()


def measured_peaks(network: Network, sides: list[int], tiles: int) -> dict[int, list[int]]:
    argv = [sys.executable, __file__, "--memory-worker", json.dumps({"network": asdict(network), "sides": sides,
                                                                     "tiles": tiles})]
    done = run_job(processes(tiles), argv)
    return {int(s): p for s, p in last_json(done.stdout, MEMORY).items()}


def figure(path: Path, mpps: list[float], aucs: list[float | None], sides: list[int], one: list[float],
           tiled: list[float], caption: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    left.plot(mpps, [a if a is not None else float("nan") for a in aucs], "o-")
    left.axhline(0.5, color="grey", lw=0.8, ls="--")
    left.set(xscale="log", xlabel="µm per pixel (canvas fixed in µm)", ylabel="held-out slide AUC", ylim=(0, 1.05),
             title="what resolution buys")
    left.set_xticks(mpps, [f"{m:g}" for m in mpps])
    left.minorticks_off()
    left.invert_xaxis()
    right.plot(mpps, one, "s-", label="one process")
    right.plot(mpps, tiled, "o-", label="per rank, 2x2 tiles + layer rank")
    right.set(xscale="log", yscale="log", xlabel="µm per pixel", ylabel="measured peak MiB per rank",
              title="memory of one step")
    right.set_xticks(mpps, [f"{m:g}\n{s} px" for m, s in zip(mpps, sides)])
    right.minorticks_off()
    right.invert_xaxis()
    right.legend(fontsize=8)
    fig.suptitle(caption, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slides", type=int, default=24)
    parser.add_argument("--slide-um", type=float, default=192.0, help="slide side (µm); level 0 at 0.5 µm/px")
    parser.add_argument("--canvas-um", type=float, default=128.0, help="canvas side (µm), the same at every mpp")
    parser.add_argument("--mpps", default="0.5,1,2,4", help="the four resolutions (µm per pixel)")
    parser.add_argument("--steps", type=int, default=48, help="optimizer steps (batch 1) per run")
    parser.add_argument("--seeds", type=int, default=1, help="runs per resolution (seeds 0..N-1; AUC: their mean)")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-filters", type=int, default=8)
    parser.add_argument("--pool", default="max", choices=["max", "attention", "tissue-mean"])
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-fraction", type=float, default=0.34)
    parser.add_argument("--figure", type=Path, default=None, help="write the figure (PNG) here")
    parser.add_argument("--memory-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_worker:
        job = json.loads(args.memory_worker)
        memory_worker(Network(**job["network"]), job["sides"], job["tiles"])
        return
    footer = Footer()
    network = Network(args.num_layers, args.num_filters, args.pool)
    mpps = [float(m) for m in args.mpps.split(",")]
    sides = [int(round(args.canvas_um / m)) for m in mpps]
    multiple = canvas_multiple(TILES, RESNET_STRIDE)
    wrong = [f"{m:g} µm/px -> {s} px" for m, s in zip(mpps, sides) if s % multiple]
    if wrong:
        raise SystemExit(f"--canvas-um {args.canvas_um:g}: {', '.join(wrong)} is not a multiple of {multiple} "
                         f"(2x2 tiles of whole ResNet strides); choose a canvas whose sizes are")
    print(f"ResNet v1 {args.num_layers} x {args.num_filters}, --pool {args.pool}, {args.slides} slides, canvas "
          f"{args.canvas_um:g} µm, {args.steps} steps of batch 1 ({args.optimizer}, lr {args.lr:g}), "
          f"{args.seeds} seed(s); training on {layout_name(TILES)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-resolution-") as tmp:
        folder = Path(tmp)
        cohort, _ = write_synthetic_cohort(folder / "cohort", slides=args.slides, side_um=args.slide_um, mpp=0.5,
                                           levels=4)
        runs: list[list[Trained]] = []
        for mpp, side in zip(mpps, sides):
            runs.append([train(cohort, network, mpp, side, args.steps, seed, args, folder)
                         for seed in range(args.seeds)])
            aucs = ", ".join(figure_text(r.slide_auc) for r in runs[-1])
            print(f"  {mpp:g} µm/px, {side} px: held-out slide AUC {aucs} ({runs[-1][0].held_out} slides)",
                  flush=True)
    one = measured_peaks(network, sides, 1)
    tiled = measured_peaks(network, sides, TILES)

    def mean(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.fmean(known) if known else None

    slide_aucs = [mean([r.slide_auc for r in rs]) for rs in runs]
    patient_aucs = [mean([r.patient_auc for r in rs]) for rs in runs]
    table = Table([">µm/px", ">canvas px", ">Mpx", ">held-out slides", ">slide AUC", ">patient AUC",
                   ">peak MiB, one process", ">peak MiB per rank, 2x2 tiles + layer rank (largest)", ">ratio"])
    for mpp, side, rs, slide_auc, patient_auc in zip(mpps, sides, runs, slide_aucs, patient_aucs):
        table.add(f"{mpp:g}", side, f"{side * side / 1e6:.3f}", rs[0].held_out, figure_text(slide_auc),
                  figure_text(patient_auc),
                  f"{max(one[side]) / MIB:.1f}", f"{max(tiled[side]) / MIB:.1f}",
                  f"{max(tiled[side]) / max(one[side]):.2f}")
    print("\n" + table.markdown())
    if args.figure is not None:
        figure(args.figure, mpps, slide_aucs, sides, [max(one[s]) / MIB for s in sides],
               [max(tiled[s]) / MIB for s in sides],
               f"synthetic cohort, {args.slides} slides, canvas {args.canvas_um:g} µm; ResNet v1 {args.num_layers}x"
               f"{args.num_filters}, --pool {args.pool}, {args.steps} steps, {args.seeds} seed(s)")
        print(f"figure: {args.figure}")
    footer.print()


if __name__ == "__main__":
    main()
