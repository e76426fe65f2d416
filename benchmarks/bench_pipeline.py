"""Pipeline throughput vs micro-batches (against the ideal bubble formula) and GEMS vs LP.

Run (2 stages on 2 ranks; all numbers come from one run on one machine):

    MPIR_CVAR_ENABLE_HEAVY_YIELD=1 OMP_NUM_THREADS=1 \\
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/bench_pipeline.py \\
        --image-size 128 --batch 8 --steps 6 --schedule gpipe

Part 1 trains the same model with ``parts`` m = 1, 2, 4, 8 on a fixed global batch and
prints images/s, the speed-up over m = 1 (plain layer parallelism) and the ideal speed-up
``S*m / (m + S - 1)`` of a pipeline with S equal stages (bubble (S-1)/(m+S-1)).
Part 2 compares GEMS (times=1: one sample per replica direction, 2 per step) with plain
LP at batch 1; the ideal is S x LP for S equal stages (every rank busy in both
directions). A serial single-process run of the same model (rank 0) is timed too. All
configurations are timed in turns, round after round, so load on a shared machine hits
them alike; each figure is the median over rounds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import mpi4dl_nb as dl  # noqa: E402


def conv_stack(depth: int, channels: int, classes: int = 10, seed: int = 0) -> list[nn.Module]:
    """``depth`` equal conv-BN-ReLU layers (so stages are balanced) and a small head."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, channels, 3, padding=1),
                                             nn.BatchNorm2d(channels), nn.ReLU())]
    for _ in range(depth - 1):
        layers.append(nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1),
                                    nn.BatchNorm2d(channels), nn.ReLU()))
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)))
    return layers


def make_engine(ctx, cfg: dl.ParallelConfig, args, batch: int):
    """An engine on balanced stages and its fixed batch."""
    layers = conv_stack(args.depth, args.channels)
    balance = [args.depth // cfg.split_size] * cfg.split_size
    balance[-1] += args.depth - sum(balance) + 1
    cfg = cfg.with_(balance=tuple(balance))
    engine = dl.HybridEngine(layers, cfg, ctx, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, args.image_size, args.image_size, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return lambda: engine.train_step(x, y)


def make_serial(args, batch: int):
    model = nn.Sequential(*conv_stack(args.depth, args.channels))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, 3, args.image_size, args.image_size)
    y = torch.randint(0, 10, (batch,))

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def time_round_robin(ctx, runs: dict[str, tuple[str, object]], steps: int) -> dict[str, float]:
    """Median seconds per step of every run, timed in turns so load noise hits all alike.

    ``runs``: name -> ("engine", step fn on all ranks) or ("serial", step fn on rank 0).
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(steps + 1):      # round 0 warms up
        for name, (kind, step) in runs.items():
            ctx.barrier()
            start = time.perf_counter()
            if kind == "engine" or ctx.rank == 0:
                step()
            ctx.barrier()
            if round_index:
                times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    parser.add_argument("--micro-batches", default="1,2,4,8")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = dl.init()
    stages = ctx.world_size
    runs: dict[str, tuple[str, object]] = {}
    runs["serial"] = ("serial", make_serial(args, args.batch) if ctx.rank == 0 else None)
    runs["serial1"] = ("serial", make_serial(args, 1) if ctx.rank == 0 else None)
    micro = [int(v) for v in args.micro_batches.split(",") if args.batch % int(v) == 0]
    for m in micro:
        cfg = dl.ParallelConfig(split_size=stages, spatial_size=0, parts=m, schedule=args.schedule)
        runs[f"m{m}"] = ("engine", make_engine(ctx, cfg, args, args.batch))
    runs["lp1"] = ("engine", make_engine(ctx, dl.ParallelConfig(split_size=stages, spatial_size=0),
                                         args, 1))
    runs["gems"] = ("engine", make_engine(ctx, dl.ParallelConfig(split_size=stages, spatial_size=0,
                                                                  times=1), args, 2))
    med = time_round_robin(ctx, runs, args.steps)
    ctx.tracer.clear()
    serial, serial1, lp1, gems = med["serial"], med["serial1"], med["lp1"], med["gems"]
    rows = [(m, med[f"m{m}"]) for m in micro]

    if ctx.rank == 0:
        print(f"# {stages} stages, {args.depth} conv layers x {args.channels} ch, image "
              f"{args.image_size}, batch {args.batch}, schedule {args.schedule}, "
              f"{args.steps} rounds, configurations timed in turns (median)")
        print(f"serial (1 process): {serial:.3f} s/step, {args.batch / serial:.2f} img/s")
        base = rows[0][1]
        print(f"{'m':>3} {'s/step':>8} {'img/s':>8} {'vs m=1':>7} {'ideal':>7} {'eff':>6} "
              f"{'vs serial':>9}")
        for m, t in rows:
            ideal = stages * m / (m + stages - 1)
            speed = base / t
            print(f"{m:>3} {t:>8.3f} {args.batch / t:>8.2f} {speed:>7.2f} {ideal:>7.2f} "
                  f"{speed / ideal:>6.0%} {serial / t:>9.2f}")
        print(f"batch 1: serial {1 / serial1:.2f} img/s, LP {1 / lp1:.2f} img/s, GEMS (2 "
              f"replicas x 1) {2 / gems:.2f} img/s: GEMS/LP = {(2 / gems) / (1 / lp1):.2f} "
              f"(ideal {stages:.2f})")
    ctx.barrier()


if __name__ == "__main__":
    main()
