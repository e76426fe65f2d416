"""Layer timing inside a live job: each layer timed alone (its runs in a row) vs every layer timed
together in interleaved rounds (``LayerTimer.measure``), side by side.

    OMP_NUM_THREADS=1 mpiexec -n 5 python benchmarks/bench_layer_timing.py --repeats 5

Rank 0 predicts the same configurations (suggest's candidates of the hardest ``bench_suggest``
scenario, ResNet-11 width 8 at 384 px, 5 ranks) ``--repeats`` times per method with a fresh
timer each time, the methods alternating, while the other ranks wait as in ``tune`` (the job's
calibrated network for all). Printed per configuration: the predictions' spread (largest /
smallest), and per repeat which configuration came first. Smaller spread = the ranking depends
less on when each layer happened to be timed.
"""

from __future__ import annotations

import argparse
import statistics
import time

from support.machine import Footer

import mpi4dl_nb as dl
from mpi4dl_nb.config import ParallelConfig
from mpi4dl_nb.measure import trials
from mpi4dl_nb.measure.calibration import calibrate_job
from mpi4dl_nb.planner.layer_timer import LayerTimer
from mpi4dl_nb.planner.step_time import step_model, time_layers
from mpi4dl_nb.planner.suggest import describe_config
from mpi4dl_nb.planner.timing import network_of

SP1X4 = dict(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="vertical")
CONFIGS = [
    ParallelConfig(**SP1X4),
    ParallelConfig(**SP1X4, parts=2, schedule="1f1b"),
    ParallelConfig(**SP1X4, times=1),
    ParallelConfig(**dict(SP1X4, slice_method="horizontal")),
    ParallelConfig(**dict(SP1X4, num_spatial_parts=2, spatial_size=2, split_size=3), parts=2, schedule="1f1b"),
    ParallelConfig(split_size=4, spatial_size=1, num_spatial_parts=2, slice_method="horizontal", times=1),
]
METHODS = ("alone", "together")


def predict_all(method: str, network, threads: int, device: str) -> list[float]:
    layers = trials.ModelSpec("resnet", 11, 8).build()
    timer = LayerTimer(device, 5, threads)     # the job's device, where its ranks run
    models = [step_model(layers, cfg, 384, 2, network=network, timer=timer) for cfg in CONFIGS]
    if method == "together":
        time_layers(models)
    return [m.predict().seconds for m in models]     # "alone": each layer timed when first needed


def relative_spread(rows: list[list[float]], index: int) -> float:
    """Spread of configuration ``index``'s prediction relative to the mean of its timing's predictions
    (the machine's speed at that timing divided out: what decides the ranking)."""
    shares = [row[index] / statistics.mean(row) for row in rows]
    return max(shares) / min(shares)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4, help="fresh timings per method")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1 (timings per way)")
    footer = Footer()
    ctx = dl.init()
    calibration = calibrate_job(ctx)
    network = network_of(calibration)
    found: dict[str, list[list[float]]] = {m: [] for m in METHODS}
    began = time.perf_counter()
    for _ in range(args.repeats):
        for method in METHODS:
            if ctx.rank == 0:
                found[method].append(predict_all(method, network, calibration.threads, calibration.device))
            ctx.barrier()
    if ctx.rank != 0:
        return 0
    print(f"network: {network.describe()}; {args.repeats} timings per method, alternating\n")
    print(f"{'configuration':70s} " + "  ".join(f"{m + ' spread':>15s}" for m in METHODS))
    for index, cfg in enumerate(CONFIGS):
        spreads = [max(r[index] for r in found[m]) / min(r[index] for r in found[m]) for m in METHODS]
        print(f"{describe_config(cfg):70s} " + "  ".join(f"{s:15.2f}" for s in spreads))
    print("\npredicted seconds per timing (columns: the configurations above, in order)")
    for method in METHODS:
        for row in found[method]:
            print(f"  {method:9s} " + " ".join(f"{x:.3f}" for x in row))
    for method in METHODS:
        firsts = [min(range(len(CONFIGS)), key=lambda i, r=r: r[i]) + 1 for r in found[method]]
        spreads = [max(r[i] for r in found[method]) / min(r[i] for r in found[method]) for i in range(len(CONFIGS))]
        relative = [relative_spread(found[method], i) for i in range(len(CONFIGS))]
        print(f"{method:9s} spread median {statistics.median(spreads):.2f}, worst {max(spreads):.2f}; "
              f"relative to the timing's mean: median {statistics.median(relative):.3f}, worst {max(relative):.3f}; "
              f"first choice per timing: {firsts}")
    print(f"{time.perf_counter() - began:.0f} s")
    footer.print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
