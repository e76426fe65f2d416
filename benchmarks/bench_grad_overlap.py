"""Gradient all-reduce overlapped with backward: data_parallel=2 and local_dp=2 on a ResNet, with and without overlap.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/bench_grad_overlap.py --backend mpi
    (and --backend gloo: the torch plane, whose all-reduce progresses on gloo's own threads)

Per layout, three engines on the same model and batch, timed in turns (rounds alternate them):
``grad_bucket_mb=None`` (one all-reduce per stage after all backwards: the old path), 25 MB
buckets (the engine's default, DDP's: one bucket for a small model, so little to overlap) and ``--small-mb``
buckets. Printed per configuration (median over the measured steps, slowest rank): step
seconds, the exposed all-reduce seconds (the ALLREDUCE action: with overlap, posting the
rest, waiting and writing back; without, the whole reduction), the share of the old path's
all-reduce time hidden behind backward (1 - exposed / exposed without overlap), buckets and
how many were posted during backward. Float32, SGD; the engines' weights are checked equal
to each other after the run (1e-5 relative: float32 summation order).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from support.machine import Footer
from support.tables import Table
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.comm.trace import Event
from mpi4dl_nb.models.build import build_model

LAYOUTS = {"data_parallel=2": dict(split_size=1, spatial_size=0, data_parallel=2),
           "local_dp=2": dict(split_size=1, spatial_size=0, local_dp=2)}


def make_engine(ctx, args, layout: dict, bucket_mb: float | None) -> dl.HybridEngine:
    torch.manual_seed(0)
    layers = build_model("resnet", num_layers=args.depth, num_filters=args.width, num_classes=10)
    cfg = dl.ParallelConfig(**layout, grad_bucket_mb=bucket_mb)
    return dl.HybridEngine(layers, cfg, ctx, loss_fn=nn.CrossEntropyLoss(),
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.01))


def step_figures(events: list[Event]) -> tuple[float, float, int, int]:
    """(step s, exposed all-reduce s, buckets posted, posted during backward) of one step's events."""
    start = min(e.start for e in events)
    end = max(e.end for e in events)
    exposed = sum(e.duration for e in events if e.op == "ALLREDUCE")
    posts = [e for e in events if e.op == "allreduce-post"]
    during = sum(1 for e in posts if e.extra.get("during_backward") == 1)
    return end - start, exposed, len(posts), during


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="mpi")
    parser.add_argument("--depth", type=int, default=20, help="ResNet depth (v2: 9n+2)")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per round and configuration")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small-mb", type=float, default=0.25)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    footer = Footer()
    ctx = dl.init(backend=args.backend)
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=gen)
    labels = torch.randint(0, 10, (args.batch,), generator=gen)
    buckets: list[float | None] = [None, 25.0, args.small_mb]
    table = Table(["layout", "buckets", ">MB reduced", ">step s", ">exposed all-reduce ms", ">hidden",
                   ">buckets (during backward)", ">vs no overlap"])
    for name, layout in LAYOUTS.items():
        engines = {mb: make_engine(ctx, args, layout, mb) for mb in buckets}
        figures: dict[float | None, list[tuple[float, float, int, int]]] = {mb: [] for mb in buckets}
        for engine in engines.values():   # warm-up (and the first step's bucket re-cut)
            engine.train_step(images, labels)
        for _ in range(args.rounds):
            for mb, engine in engines.items():
                for _ in range(args.steps):
                    position = ctx.tracer.recorded
                    engine.train_step(images, labels)
                    figures[mb].append(step_figures(ctx.tracer.since(position)))
        mine = {mb: (statistics.median(f[0] for f in rows), statistics.median(f[1] for f in rows),
                     rows[-1][2], rows[-1][3]) for mb, rows in figures.items()}
        everyone = ctx.all_gather_object(mine)
        states = [engine.full_state_dict() for engine in engines.values()]
        if ctx.rank != 0:
            continue
        for key in states[0]:
            for other in states[1:]:
                if states[0][key].is_floating_point():
                    scale = max(states[0][key].abs().max().item(), 1e-6)
                    err = (other[key] - states[0][key]).abs().max().item() / scale
                    assert err < 1e-5, f"{name}: {key} differs by {err:.1e} between the configurations"
        worst = {mb: tuple(max(r[mb][i] for r in everyone) for i in range(2)) for mb in buckets}
        reduced = sum(p.numel() * p.element_size() for p in engines[None].instances[(0, 0)].canonical.parameters())
        base_step, base_exposed = worst[None]
        for mb in buckets:
            step, exposed = worst[mb]
            posted, during = mine[mb][2], mine[mb][3]
            hidden = "-" if mb is None else f"{1 - exposed / base_exposed:.0%}"
            table.add(name, "none (after backward)" if mb is None else f"{mb:g} MB", f"{reduced / 2**20:.2f}",
                      f"{step:.3f}", f"{exposed * 1e3:.1f}", hidden,
                      "-" if mb is None else f"{posted} ({during})", f"{base_step / step:.2f}x")
    if ctx.rank == 0:
        print(f"ResNet-{args.depth} width {args.width}, float32, image {args.image_size}, global batch "
              f"{args.batch}, backend {args.backend}, {args.rounds} rounds x {args.steps} steps, median, "
              f"slowest rank")
        print(table.text(args.markdown))
        footer.print()


if __name__ == "__main__":
    main()
