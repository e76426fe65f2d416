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

``--new-schedules`` runs part 3 instead: the schedules of issue 44 beside their peers in
torch.distributed.pipelining, all in one job on S = the job's ranks (run it with 2 and with 4):
1F1B (``Schedule1F1B``), interleaved with V = 2 chunks per rank (``ScheduleInterleaved1F1B``, stage
s on rank s mod S), ZB-H1 ``zb1`` (``ScheduleInterleavedZeroBubble`` on the same one stage per rank)
and the V-shaped ``zbv`` (``ScheduleZBVZeroBubble``, ranks r holding stages r and 2S-1-r), for
m = 2, 4, 8 micro-batches, on the same layers, cut (``balance_of`` over the S or 2S stages), batch
and micro-batches. Per configuration: s/step (median over rounds, in turns), the speed-up over the
serial run, on our row the peer's s/step over ours (``peer/ours``: > 1 when ours is faster), the
measured bubble ``1 - serial / (S x step)`` beside the schedule's own
(``planner.schedule_replay``: equal stages, F = I = W, no wire), and the peak activation bytes per
rank (``ActivationMeter`` over one more step, the largest rank). A configuration a side cannot run
(too few micro-batches, not built yet) shows ``-`` and the reason under the table::

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/bench_pipeline.py --new-schedules
    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/bench_pipeline.py --new-schedules
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


NEW_SCHEDULES = ("1f1b", "interleaved", "zb1", "zbv")
VIRTUAL = {"1f1b": 1, "interleaved": 2, "zb1": 1, "zbv": 2}     # chunks (stages) per rank


def peer_stages(schedule: str, rank: int, ranks: int) -> list[int]:
    """The stages rank ``rank`` holds in torch.distributed.pipelining's layout of ``schedule``."""
    if schedule == "zbv":                       # V: down the ranks, then back up
        return [rank, 2 * ranks - 1 - rank]
    return [rank + c * ranks for c in range(VIRTUAL[schedule])]


def peer_runner(schedule: str, stages: list, micro_batches: int):
    """torch.distributed.pipelining's schedule object for ``schedule`` over this rank's ``stages`` (one for 1f1b)."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    if schedule == "1f1b":
        return Schedule1F1B(stages[0], micro_batches, loss_fn=nn.functional.cross_entropy)
    kind = {"interleaved": ScheduleInterleaved1F1B, "zb1": ScheduleInterleavedZeroBubble,
            "zbv": ScheduleZBVZeroBubble}[schedule]
    return kind(stages, micro_batches, loss_fn=nn.functional.cross_entropy)


def make_new_peer(args, schedule: str, micro_batches: int):
    """torch.distributed.pipelining's ``schedule`` on the cut ``balance_of(depth, S*V)``; its step, and its
    step under an ActivationMeter (peak bytes)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    rank, ranks = dist.get_rank(), dist.get_world_size()
    count = ranks * VIRTUAL[schedule]
    balance = balance_of(args.depth, count)
    layers = layer_stack(args.depth, args.channels)
    mine = peer_stages(schedule, rank, ranks)
    stages = [PipelineStage(nn.Sequential(*layers[sum(balance[:i]):sum(balance[:i + 1])]), i, count,
                            torch.device("cpu")) for i in mine]
    params = [p for stage in stages for p in stage.submod.parameters()]
    runner = peer_runner(schedule, stages, micro_batches)
    opt = torch.optim.SGD(params, lr=0.01)
    x, y = batch_of(args)
    inputs = {"x": x} if 0 in mine else {}
    target = {"target": y} if count - 1 in mine else {}

    def step() -> None:
        opt.zero_grad()
        runner.step(*inputs.values(), **target)
        opt.step()
    return step


def batch_of(args) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(args.batch, 3, args.image_size, args.image_size, generator=gen),
            torch.randint(0, 10, (args.batch,), generator=gen))


def new_schedule_config(schedule: str, ranks: int, micro_batches: int) -> dl.ParallelConfig:
    return dl.ParallelConfig(split_size=ranks * VIRTUAL[schedule], spatial_size=0, parts=micro_batches,
                             schedule=schedule, virtual_stages=VIRTUAL[schedule])


def ideal_bubble(cfg: dl.ParallelConfig) -> float:
    """The schedule's own bubble share (equal stages, F = I = W, no wire: ``planner.schedule_replay``)."""
    from mpi4dl_nb.pipeline.schedules import build_schedule
    from mpi4dl_nb.planner.schedule_replay import replay_schedule
    return replay_schedule(build_schedule(cfg)).bubble_share


def ours_config(schedule: str, ranks: int, micro_batches: int, batch: int) -> tuple[dl.ParallelConfig | None, str]:
    """The engine's configuration of ``schedule``, or None and why it cannot run it: its ConfigError, or a
    split-backward schedule whose action lists have no input-gradient actions (not built on this commit)."""
    from mpi4dl_nb.pipeline.actions import ActionKind
    from mpi4dl_nb.pipeline.schedules import build_schedule
    try:
        cfg = new_schedule_config(schedule, ranks, micro_batches)
        cfg.validate(batch_size=batch)
        built = build_schedule(cfg)
    except (dl.ConfigError, ValueError) as error:
        return None, str(error).splitlines()[0]
    split = any(a.kind is ActionKind.BACKWARD_INPUT for actions in built.per_rank for a in actions)
    if schedule in ("zb1", "zbv") and not split:
        return None, f"{schedule}: no split backward in this commit's schedule"
    return cfg, ""


def peer_refusal(schedule: str, ranks: int, micro_batches: int, batch: int) -> str | None:
    """Why torch.distributed.pipelining refuses (None: it runs): the limits its schedules check."""
    if batch % micro_batches:
        return f"peer: batch {batch} does not split into {micro_batches} micro-batches"
    if micro_batches < ranks:
        return f"peer {schedule}: {micro_batches} micro-batches, fewer than its {ranks} ranks (it refuses them)"
    if schedule != "1f1b" and micro_batches % ranks:
        return f"peer {schedule}: {micro_batches} micro-batches are not a multiple of {ranks} ranks"
    return None


def new_schedules(ctx, args) -> None:
    """Part 3 (module docstring): issue 44's schedules beside torch.distributed.pipelining's, one job."""
    from mpi4dl_nb.comm.waiting import node_cores
    from mpi4dl_nb.measure.usage import ActivationMeter
    ranks = ctx.world_size
    micro = [int(v) for v in args.micro_batches.split(",")]
    schedules = [s for s in args.schedules.split(",") if s]
    runs: dict[str, object] = {"serial": make_serial(args, args.batch) if ctx.rank == 0 else None}
    notes: dict[str, str] = {}
    configs: dict[str, dl.ParallelConfig] = {}
    for m in micro:
        for schedule in schedules:
            cfg, why = ours_config(schedule, ranks, m, args.batch)
            if cfg is not None:
                configs[f"{schedule}/{m}"] = cfg
                runs[f"ours {schedule}/{m}"] = make_engine(ctx, cfg, args, args.batch)
            else:
                notes[f"ours {schedule}/{m}"] = why
            refused = peer_refusal(schedule, ranks, m, args.batch) if not args.no_peer else "left out (--no-peer)"
            if refused is None:
                runs[f"peer {schedule}/{m}"] = make_new_peer(args, schedule, m)
            else:
                notes[f"peer {schedule}/{m}"] = refused
    med = in_turns(ctx, runs, args.steps)
    peaks: dict[str, int] = {}
    for name, run in runs.items():          # one more step each under the meter: saved activations' peak
        if run is None or name == "serial":
            continue
        meter = ActivationMeter()
        ctx.barrier()
        with meter:
            run()
        peaks[name] = max(ctx.all_gather_object(meter.peak))
    ctx.tracer.clear()
    if ctx.rank:
        return
    serial = med["serial"]
    cores = node_cores()
    crowded = (f"; {ranks} ranks on {cores} cores: OVERSUBSCRIBED, ranks share cores (bubbles partly hidden, "
               f"compute slowed)" if cores and ranks > cores else "")
    print(f"# issue 44 schedules, S = {ranks} ranks, {args.depth} conv layers x {args.channels} ch, image "
          f"{args.image_size}, batch {args.batch}, {args.steps} rounds in turns (median){crowded}")
    print(f"serial (1 process): {serial:.3f} s/step")
    table = Table(["schedule", ">m", "side", ">s/step", ">vs serial", ">peer/ours", ">bubble", ">ideal",
                   ">peak MB/rank"])
    for m in micro:
        for schedule in schedules:
            ideal = ideal_bubble(configs[f"{schedule}/{m}"]) if f"{schedule}/{m}" in configs else None
            for side in ("ours", "peer"):
                name = f"{side} {schedule}/{m}"
                label = "mpi4dl-nb" if side == "ours" else "torch.distributed.pipelining"
                if name not in runs:
                    table.add(schedule, m, label, "-", "-", "-", "-", "-", "-")
                    continue
                t = med[name]
                bubble = 1 - serial / (ranks * t)
                peer = med.get(f"peer {schedule}/{m}")
                # the peer's step over ours, on our row (> 1: ours is faster)
                ratio = f"{peer / t:.2f}" if side == "ours" and peer is not None else "-"
                table.add(schedule, m, label, f"{t:.3f}", f"{serial / t:.2f}", ratio, f"{bubble:.0%}",
                          f"{ideal:.0%}" if ideal is not None else "-", f"{peaks[name] / 2**20:.1f}")
    print(table.markdown())
    for name, note in notes.items():
        print(f"- {name}: {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", type=int, default=None, help="default 128 (--new-schedules: 64)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None,
                        help="rounds; default 6 (--new-schedules: 10: a median of 4 moved by 5%% between runs)")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    parser.add_argument("--micro-batches", default=None, help="default 1,2,4,8 (--new-schedules: 2,4,8)")
    parser.add_argument("--no-peer", action="store_true", help="leave out torch.distributed.pipelining")
    parser.add_argument("--new-schedules", action="store_true",
                        help="part 3: 1f1b, interleaved (V=2), zb1, zbv beside torch.distributed.pipelining's "
                             "(defaults then: image 64, micro-batches 2,4,8)")
    parser.add_argument("--schedules", default=",".join(NEW_SCHEDULES),
                        help="with --new-schedules: which of " + ",".join(NEW_SCHEDULES))
    args = parser.parse_args()
    args.image_size = args.image_size or (64 if args.new_schedules else 128)
    args.steps = args.steps or (10 if args.new_schedules else 6)
    args.micro_batches = args.micro_batches or ("2,4,8" if args.new_schedules else "1,2,4,8")
    if args.new_schedules:
        footer = Footer()
        torch.set_num_threads(1)
        ctx = dl.init()
        plane = None if args.no_peer else Context(backend="gloo", trace=False)
        new_schedules(ctx, args)
        if ctx.rank == 0:
            footer.print()
        ctx.barrier()
        if plane is not None:
            plane.close()
        return
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
