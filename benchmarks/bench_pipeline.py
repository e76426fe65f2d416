"""Pipeline throughput vs micro-batches (against the ideal bubble formula) and GEMS vs LP.

Run (2 stages on 2 ranks; all numbers come from one run on one machine):

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/bench_pipeline.py --image-size 128 --batch 8 --steps 6

Part 1 trains the same model with ``parts`` m = 1, 2, 4, 8 on a fixed global batch and
prints images/s, the speed-up over m = 1 (plain layer parallelism) and the ideal speed-up
``S*m / (m + S - 1)`` of a pipeline with S equal stages (bubble (S-1)/(m+S-1)).
Part 2 compares GEMS (times=1: one sample per replica direction, 2 per step) with plain
LP at batch 1; the ideal is S x LP for S equal stages (every rank busy in both
directions). A serial single-process run of the same model (rank 0) is timed too, and the peer,
torch.distributed.pipelining (gloo; same layers, balance, schedule, batch and micro-batches;
``--no-peer`` leaves it out). All configurations are timed in turns, round after round, so load
on a shared machine hits them alike; each figure is the median over rounds.
"""

from __future__ import annotations

import argparse

import torch
from support.machine import Footer
from support.tables import Table
from support.timing import in_turns
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.comm.context import Context


def layer_stack(depth: int, channels: int, classes: int = 10, seed: int = 0) -> list[nn.Module]:
    """``depth`` equal conv-BN-ReLU layers (so stages are balanced) and a small head."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, channels, 3, padding=1),
                                             nn.BatchNorm2d(channels), nn.ReLU())]
    for _ in range(depth - 1):
        layers.append(nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1),
                                    nn.BatchNorm2d(channels), nn.ReLU()))
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)))
    return layers


def balance_of(depth: int, stages: int) -> list[int]:
    """Equal conv layers per stage; the last stage also takes the remainder and the head."""
    balance = [depth // stages] * stages
    balance[-1] += depth - sum(balance) + 1
    return balance


def make_engine(ctx, cfg: dl.ParallelConfig, args, batch: int):
    """An engine on balanced stages and its fixed batch."""
    layers = layer_stack(args.depth, args.channels)
    cfg = cfg.with_(balance=tuple(balance_of(args.depth, cfg.split_size)))
    engine = dl.HybridEngine(layers, cfg, ctx, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, args.image_size, args.image_size, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return lambda: engine.train_step(x, y)


def make_serial(args, batch: int):
    model = nn.Sequential(*layer_stack(args.depth, args.channels))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, 3, args.image_size, args.image_size)
    y = torch.randint(0, 10, (batch,))

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def make_peer(args, micro_batches: int, batch: int):
    """The peer: torch.distributed.pipelining on the same layers, balance, schedule and batch (gloo between
    the ranks). It infers the stages' shapes at its first step (a forward on an uninitialised buffer: harmless
    to its speed, and that step is the warm-up round's)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, stages = dist.get_rank(), dist.get_world_size()
    balance = balance_of(args.depth, stages)
    first = sum(balance[:rank])
    module = nn.Sequential(*layer_stack(args.depth, args.channels)[first:first + balance[rank]])
    side = args.image_size
    stage = PipelineStage(module, rank, stages, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    schedule = kind(stage, micro_batches, loss_fn=nn.functional.cross_entropy)
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, side, side, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)

    def step() -> None:
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == stages - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        opt.step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    parser.add_argument("--micro-batches", default="1,2,4,8")
    parser.add_argument("--no-peer", action="store_true", help="leave out torch.distributed.pipelining")
    args = parser.parse_args()
    footer = Footer()
    torch.set_num_threads(1)
    ctx = dl.init()
    peer_plane = None if args.no_peer else Context(backend="gloo", trace=False)   # torch.distributed, for the peer
    stages = ctx.world_size
    runs = {"serial": make_serial(args, args.batch) if ctx.rank == 0 else None,
            "serial1": make_serial(args, 1) if ctx.rank == 0 else None}
    micro = [int(v) for v in args.micro_batches.split(",") if args.batch % int(v) == 0]
    for m in micro:
        cfg = dl.ParallelConfig(split_size=stages, spatial_size=0, parts=m, schedule=args.schedule)
        runs[f"m{m}"] = make_engine(ctx, cfg, args, args.batch)
        if not args.no_peer and (args.schedule == "gpipe" or m >= stages):   # its 1F1B needs m >= stages
            runs[f"peer{m}"] = make_peer(args, m, args.batch)
    runs["lp1"] = make_engine(ctx, dl.ParallelConfig(split_size=stages, spatial_size=0), args, 1)
    runs["gems"] = make_engine(ctx, dl.ParallelConfig(split_size=stages, spatial_size=0, times=1), args, 2)
    med = in_turns(ctx, runs, args.steps)
    ctx.tracer.clear()
    serial, serial1, lp1, gems = med["serial"], med["serial1"], med["lp1"], med["gems"]

    if ctx.rank == 0:
        print(f"# {stages} stages, {args.depth} conv layers x {args.channels} ch, image "
              f"{args.image_size}, batch {args.batch}, schedule {args.schedule}, "
              f"{args.steps} rounds, configurations timed in turns (median)")
        print(f"serial (1 process): {serial:.3f} s/step, {args.batch / serial:.2f} img/s")
        columns = ["m", ">s/step", ">img/s", ">vs m=1", ">ideal", ">eff", ">vs serial"]
        if not args.no_peer:
            columns += [">torch.distributed.pipelining s/step", ">peer vs serial"]
        table = Table(columns)
        base = med[f"m{micro[0]}"]
        for m in micro:
            t = med[f"m{m}"]
            ideal = stages * m / (m + stages - 1)
            cells = [m, f"{t:.3f}", f"{args.batch / t:.2f}", f"{base / t:.2f}", f"{ideal:.2f}",
                     f"{base / t / ideal:.0%}", f"{serial / t:.2f}"]
            if not args.no_peer:
                peer = med.get(f"peer{m}")
                cells += [f"{peer:.3f}", f"{serial / peer:.2f}"] if peer else ["-", "-"]
            table.add(*cells)
        print(table.markdown())
        print(f"batch 1: serial {1 / serial1:.2f} img/s, LP {1 / lp1:.2f} img/s, GEMS (2 "
              f"replicas x 1) {2 / gems:.2f} img/s: GEMS/LP = {(2 / gems) / (1 / lp1):.2f} "
              f"(ideal {stages:.2f})")
        footer.print()
    ctx.barrier()
    if peer_plane is not None:
        peer_plane.close()


if __name__ == "__main__":
    main()
