"""Planner predictions vs measurements per rank: peak memory and step time, configurations side by side.

    python benchmarks/bench_planner.py                                   # ResNet-11 v2 w16 128 px
    python benchmarks/bench_planner.py --model resnet --depth 20 --width 8 --image-size 256
    python benchmarks/bench_planner.py --model amoebanet --depth 6 --width 32 --image-size 128
    python benchmarks/bench_planner.py --grid --markdown                 # the BENCHMARKS.md table
    python benchmarks/bench_planner.py --model torchvision:resnet50 --image-size 256 --configs "SP4+LP"
    python benchmarks/bench_planner.py --byom --image-size 256 --memory-only --markdown   # torchvision models

Each configuration runs on a local MPI cluster of its world size (one cluster start per
world size). On every rank: one warm-up and one measured ``HybridEngine.train_step`` under
the allocation profiler (memory), then ``--steps`` timed steps (each started together at a
barrier; the step time is the slowest rank's, the median over steps; with ``--passes 2``
the configurations of a world size are run twice and the faster median kept, and the layers
are timed afresh for each pass and the faster prediction kept). The planner predicts
both from the layer list: memory shape-only on ``meta``, time from layer times profiled
once on this process with the ranks' torch threads, a calibration on the cluster (ping-pong,
the cost of a meeting of all ranks) and the real schedule.
One line per configuration: ``worst ratio X`` (memory estimate/measured on the rank
furthest from 1) and ``time ratio Y`` (predicted/measured step time). Step times depend on
the machine's load: quote them with the load average printed at the end.
``--model`` takes any model spec the CLI takes (``torchvision:NAME``, ``timm:NAME``: cut into pieces
by ``models/cut.py``; their depth and width come with the name). ``--byom``: ResNet-50, DenseNet-121,
EfficientNet-B0 and ConvNeXt-T from torchvision in four layouts (``BYOM_CASES``); ``--memory-only``
leaves out the time prediction (the layers are not timed).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from dataclasses import dataclass

from support.machine import Footer

from mpi4dl_nb import ParallelConfig, planner
from mpi4dl_nb import cluster as clu
from mpi4dl_nb.measure import trials
from mpi4dl_nb.planner.layer_timer import LayerTimer

CASES = [
    ("serial", dict(split_size=1, spatial_size=0), 2),
    ("SP2v+LP", dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical"), 2),
    ("SP2v+LP, 2 micro-batches", dict(split_size=2, spatial_size=1, num_spatial_parts=2,
                                      slice_method="vertical", parts=2), 4),
    ("LP3, GPipe m=2", dict(split_size=3, spatial_size=0, parts=2), 2),
    ("LP3, 1F1B m=4", dict(split_size=3, spatial_size=0, parts=4, schedule="1f1b"), 4),
    ("LP3 GEMS", dict(split_size=3, spatial_size=0, times=1), 2),
    ("SP4+LP", dict(split_size=2, spatial_size=1, num_spatial_parts=4), 2),
]
# --grid: model sizes of the BENCHMARKS.md table (model, depth, width, image size)
GRID = [
    ("resnet", 11, 16, 128), ("resnet", 20, 8, 256), ("resnet", 11, 8, 384),
    ("resnet", 29, 16, 128), ("amoebanet", 6, 32, 128), ("amoebanet", 3, 64, 256),
]
# --byom: models nobody here wrote, in one process, SP+LP with micro-batches, LP with micro-batches, SP 2x2 + LP
BYOM = ["torchvision:resnet50", "torchvision:densenet121", "torchvision:efficientnet_b0", "torchvision:convnext_tiny"]
BYOM_CASES = ["serial", "SP2v+LP, 2 micro-batches", "LP3, GPipe m=2", "SP4+LP"]


@dataclass
class Row:
    model: str
    name: str
    world: int
    batch: int
    estimate: list[int]
    measured: list[int]
    predicted_time: float
    measured_time: float

    @property
    def ratios(self) -> list[float]:
        return [e / m for e, m in zip(self.estimate, self.measured)]

    @property
    def worst(self) -> float:
        return max(self.ratios, key=lambda r: abs(r - 1))

    @property
    def time_ratio(self) -> float:
        return self.predicted_time / self.measured_time


def predict_time(layers, cfg, image_size, batch, network, timer: LayerTimer) -> float:
    return planner.predict_step_time(layers, cfg, image_size, batch, network=network, timer=timer).seconds


def run_model(model: str, depth: int, width: int, image_size: int, steps: int,
              names: list[str] | None, passes: int, time_it: bool = True) -> list[Row]:
    spec = trials.ModelSpec(model, depth, width, num_classes=2)
    layers = spec.build()
    label = f"{model} {image_size}px" if spec.model.family.named else f"{model}-{depth} w{width} {image_size}px"
    cases = [c for c in CASES if names is None or c[0] in names]
    cases.sort(key=lambda case: ParallelConfig(**case[1]).world_size)
    rows = []
    for world, group in itertools.groupby(cases, key=lambda case: ParallelConfig(**case[1]).world_size):
        group = list(group)
        with clu.start(n=world, call_timeout=1800) as cluster:
            calibration = cluster.run(trials.calibrate_job_on_engine)[0]
            network = planner.network_of(calibration)
            print(f"{world} ranks: {network.describe()}; {calibration.threads} torch thread(s) per rank",
                  file=sys.stderr, flush=True)
            found: dict[str, Row] = {}
            for done in range(passes):     # each pass times the layers afresh, at another moment
                timer = LayerTimer(calibration.device, threads=calibration.threads)   # the ranks' device
                for name, knobs, batch in group:
                    cfg = ParallelConfig(**knobs)
                    measured = cluster.run(trials.measure_config_on_engine, spec, knobs, image_size, batch, steps)[0]
                    predicted = predict_time(layers, cfg, image_size, batch, network, timer) if time_it \
                        else float("nan")
                    if done == 0:
                        plan = planner.estimate_memory(layers, cfg, image_size, batch)
                        found[name] = Row(label, name, world, batch, plan.totals, list(measured.peaks), predicted,
                                          measured.seconds)
                    else:
                        row = found[name]
                        row.predicted_time = min(row.predicted_time, predicted)
                        row.measured_time = min(row.measured_time, measured.seconds)
                    print_row(found[name], markdown=False, file=sys.stderr)
            rows += [found[name] for name, _, _ in group]
    return rows


def print_row(row: Row, markdown: bool, file=sys.stdout) -> None:
    mb = 2 ** 20
    cells = "; ".join(f"r{r}: {e / mb:.1f}/{m / mb:.1f} ({e / m:.2f})"
                      for r, (e, m) in enumerate(zip(row.estimate, row.measured)))
    timed = not math.isnan(row.predicted_time)    # --memory-only: no prediction
    time_text = f"{row.predicted_time:.3f}/{row.measured_time:.3f} s" if timed else f"-/{row.measured_time:.3f} s"
    ratio = f"{row.time_ratio:.2f}" if timed else "-"
    if markdown:
        print(f"| {row.model} | {row.name} | {row.world} | {row.batch} | {row.worst:.2f} | "
              f"{ratio} | {time_text} | {cells} |", file=file)
    else:
        print(f"{row.model:24s} {row.name:26s} ranks {row.world} batch {row.batch}  worst ratio "
              f"{row.worst:.2f}  time ratio {ratio} ({time_text})  | {cells}",
              file=file, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet",
                        help="resnet, amoebanet, or a named model: torchvision:NAME, timm:NAME")
    parser.add_argument("--depth", type=int, default=11, help="ResNet depth / AmoebaNet normal cells")
    parser.add_argument("--width", type=int, default=16, help="ResNet base width / AmoebaNet filters")
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--passes", type=int, default=2,
                        help="measure and predict each configuration this many times, at different moments; "
                             "keep the fastest of each (a shared machine's slow spells only ever add time)")
    parser.add_argument("--configs", default=None, help="';'-separated configuration names")
    parser.add_argument("--grid", action="store_true", help="every model size of the BENCHMARKS.md table")
    parser.add_argument("--byom", action="store_true",
                        help="torchvision ResNet-50, DenseNet-121, EfficientNet-B0, ConvNeXt-T in BYOM_CASES")
    parser.add_argument("--memory-only", action="store_true", help="memory only: no layer timing, no time ratio")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    if args.passes < 1 or args.steps < 1:
        parser.error("--passes and --steps must be at least 1")
    names = args.configs.split(";") if args.configs else (BYOM_CASES if args.byom else None)
    models = GRID if args.grid else [(name, 0, 0, args.image_size) for name in BYOM] if args.byom else \
        [(args.model, args.depth, args.width, args.image_size)]
    footer = Footer()
    start = time.monotonic()
    rows = [row for model in models
            for row in run_model(*model, args.steps, names, args.passes, time_it=not args.memory_only)]
    if args.markdown:
        print("| model | configuration | ranks | batch | memory worst ratio | time ratio | "
              "step time predicted/measured | per rank: estimate/measured MB (ratio) |")
        print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print_row(row, args.markdown)
    memory_ok = sum(all(abs(r - 1) <= 0.15 for r in row.ratios) for row in rows)
    time_ok = sum(abs(row.time_ratio - 1) <= 0.30 for row in rows)
    timed = "step time not predicted (--memory-only)" if args.memory_only else \
        f"step time within 30%: {time_ok}/{len(rows)}"
    print(f"\nmemory within 15% on every rank: {memory_ok}/{len(rows)}; {timed} "
          f"(float32; {time.monotonic() - start:.0f} s)")
    footer.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
