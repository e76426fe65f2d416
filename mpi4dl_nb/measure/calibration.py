"""Calibrating the time model on the running job: ping-pong, the cost of a meeting, a stage
hand-off in a relay, and - only while the ranks outnumber a CPU node's cores - the crowded-core
rounds (crowded meetings, compute beside waiting ranks); ``calibrate_job`` gathers them into a
``JobCalibration``."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..comm.device import synchronize
from ..comm.protocol import Comm


def device_time(device: torch.device) -> float:
    """The host clock once ``device``'s queued work is done (on NCCL a ``wait()`` only orders the stream)."""
    synchronize(device)
    return time.perf_counter()


def ping_pong(ctx: Comm, sizes: Sequence[int] = (1024, 65536, 1 << 20, 8 << 20), repeats: int = 7,
              peers: tuple[int, int] = (0, 1)) -> list[tuple[int, float]]:
    """(bytes, median one-way seconds) per size between ranks ``peers`` through the context's
    data plane; collective (the other ranks wait), every rank gets the list. One rank: []."""
    if ctx.world_size < 2:
        return []
    a, b = peers
    points = None
    if ctx.rank in (a, b):
        other = b if ctx.rank == a else a
        points = []
        for size in sizes:
            buf = torch.zeros(max(1, size // 4), device=ctx.device)
            runs = []
            for _ in range(repeats + 1):
                start = device_time(ctx.device)
                if ctx.rank == a:
                    ctx.send(buf, other, tag=7)
                    ctx.recv(buf, other, tag=8)
                else:
                    ctx.recv(buf, other, tag=7)
                    ctx.send(buf, other, tag=8)
                runs.append((device_time(ctx.device) - start) / 2)
            points.append((buf.numel() * buf.element_size(), sorted(runs[1:])[len(runs[1:]) // 2]))
    result = ctx.bcast_object(points, root=a)
    return list(result or [])


def meeting_cost(ctx: Comm, ranks: Sequence[int] | None = None, rounds: int = 30, work_seconds: float = 1e-3,
                 repeats: int = 3, groups: Sequence[Sequence[int]] | None = None) -> float:
    """Seconds one meeting of ``ranks`` (default: all) costs beyond their work: ``rounds``
    rounds of ``work_seconds`` of compute per rank, free-running and then with a small
    all-reduce after each round, alternated ``repeats`` times (best of each); the other ranks
    wait. ``groups``: several disjoint groups instead, each meeting among its own members at
    once (GEMS's two tile groups). Collective over the world; every rank gets the result.

    Ranks that share cores (more ranks computing than cores) lose time at every meeting - the
    last one must be scheduled, the waiting ones woken - which a halo exchange or a BatchNorm
    sum of a spatial stage pays once per layer; with a core (or GPU) each it is the time to
    notice the others arrived (the wait mode's pauses, the library's latency)."""
    if groups is None:
        groups = [tuple(range(ctx.world_size)) if ranks is None else tuple(ranks)]
    everyone = [rank for members in groups for rank in members]
    if len(set(everyone)) != len(everyone) or not all(0 <= rank < ctx.world_size for rank in everyone):
        raise ValueError(f"meeting_cost groups={[tuple(g) for g in groups]}: give disjoint groups of ranks "
                         f"0..{ctx.world_size - 1} (a rank in two groups would leave the other waiting)")
    made = [(tuple(members), ctx.new_group(tuple(members))) for members in groups]
    own = next(((members, group) for members, group in made if ctx.rank in members), None)
    if all(len(members) < 2 for members, _ in made):
        return 0.0
    a = torch.randn(96, 96)

    def work(count: int) -> None:
        for _ in range(count):
            a @ a

    start = time.perf_counter()
    work(20)
    mine = torch.tensor([(time.perf_counter() - start) / 20], dtype=torch.float64, device=ctx.device)  # nccl: no host
    per_product = float(ctx.all_reduce(mine).item()) / ctx.world_size
    count = max(1, round(work_seconds / max(per_product, 1e-9)))
    flag = torch.zeros(1, device=ctx.device)
    best = {False: float("inf"), True: float("inf")}     # with meetings? -> best seconds
    for _ in range(repeats):
        for with_meetings in (False, True):
            ctx.barrier()
            start = time.perf_counter()
            if own is not None:
                for _ in range(rounds):
                    work(count)
                    if with_meetings and len(own[0]) > 1:
                        ctx.all_reduce(flag, group=own[1])
            synchronize(ctx.device)      # the meetings done, not only queued (nccl)
            ctx.barrier()
            best[with_meetings] = min(best[with_meetings], time.perf_counter() - start)
    free, meeting = best[False], best[True]
    return float(ctx.bcast_object(max(0.0, (meeting - free) / rounds), root=0))


LONG_WORK, SHORT_WORK = 1e-3, 0.25e-3    # seconds of work between the meetings ``calibrate_job`` times


def layer_work(side: int = 64, batch: int = 2) -> Callable[[], None]:
    """A few conv layers' forward and backward on ``batch`` maps of ``side`` x ``side``: work
    that touches memory like a stage does."""
    generator = torch.Generator().manual_seed(0)
    convs = [nn.Conv2d(16, 16, 3, padding=1) for _ in range(2)]
    x = torch.randn(batch, 16, side, side, generator=generator)

    def run() -> None:
        y = x
        for conv in convs:
            y = torch.relu(conv(y))
        y.sum().backward()
    return run


def waiting_slowdown(ctx: Comm, work_seconds: float = 20e-3, repeats: int = 11) -> float:
    """How much longer the ranks computing take while the others wait for them in the data
    plane's wait mode (``ctx.barrier``) than while the others sleep. As many ranks compute as
    the node has cores (leaving one rank at least to wait): >1 when the waiters' wake-ups and
    tests displace computing ranks on shared cores, ~1 with a core per rank. Slowest computing
    rank, median over ``repeats`` rounds of the two side by side. Collective; every rank gets it."""
    from ..comm.waiting import node_cores

    if ctx.world_size < 2:
        return 1.0
    computing = ctx.rank < min(node_cores(), ctx.world_size - 1)
    work = layer_work()
    once = 0.0
    if ctx.rank == 0:
        work()
        start = time.perf_counter()
        work()
        once = max(time.perf_counter() - start, 1e-6)
    count, nap = ctx.bcast_object((max(1, round(work_seconds / once)) if once else 1, 3 * work_seconds), root=0)
    if computing:
        work()
    rounds: list[tuple[float, float]] = []      # (others asleep, others waiting): this rank's seconds
    for _ in range(repeats):
        pair = []
        for waiting in (False, True):
            ctx.barrier()
            if computing:
                start = time.perf_counter()
                for _ in range(count):
                    work()
                pair.append(time.perf_counter() - start)
            elif not waiting:       # asleep well past the work: nothing polls meanwhile
                time.sleep(nap)
            ctx.barrier()
        rounds.append((pair[0], pair[1]) if pair else (0.0, 0.0))
    everyone = [r for r in ctx.all_gather_object(rounds if computing else None) if r is not None]
    ratios = [max(r[i][1] for r in everyone) / max(r[i][0] for r in everyone) for i in range(repeats)]
    return max(1.0, statistics.median(ratios))     # rounds side by side: a slow spell hits both halves


def handoff_seconds(ctx: Comm, laps: int = 6, repeats: int = 9) -> float:
    """Seconds one stage hand-off adds to a pipeline: a tiny payload relayed round every rank
    through the engine's hand-off path (``isend_payload``, ``recv_payload``), each rank running
    a few conv layers' forward and backward before passing it on - as a stage does - minus
    the same work run back to back. Wire time, both sides' bookkeeping, the receiver noticing
    its message and being scheduled again, and its work starting cold after the wait (on
    shared cores, beside the other waiting ranks) are all in it. Median of ``repeats`` relays
    of ``laps`` laps. Collective; every rank gets it (0.0 on one rank)."""
    from ..comm.messages import isend_payload, recv_payload

    if ctx.world_size < 2:
        return 0.0
    rank, world = ctx.rank, ctx.world_size
    work = layer_work()
    work()
    payload = torch.zeros(1, device=ctx.device)
    extra = []
    for _ in range(repeats):
        ctx.barrier()
        start = time.perf_counter()
        if rank == 0:
            for _ in range(laps):
                work()
        alone = (time.perf_counter() - start) / laps
        ctx.barrier()
        start = time.perf_counter()
        for lap in range(laps):
            if rank > 0 or lap > 0:
                recv_payload(ctx, (rank - 1) % world, 11, ctx.device)
            work()
            if rank < world - 1 or lap < laps - 1:
                ctx.wait_all(isend_payload(ctx, payload, (rank + 1) % world, 11))
        hop = (time.perf_counter() - start) / (laps * world)     # the last rank ends the relay
        alone, hop = ctx.bcast_object(alone, root=0), ctx.bcast_object(hop, root=world - 1)
        extra.append(max(0.0, hop - alone))
    return float(statistics.median(extra))


@dataclass(frozen=True)
class CrowdedRounds:
    """The crowded-core rounds of a calibration, run only while the job's ranks outnumber a CPU
    node's cores (``crowded_job``): the cost of a meeting of all ranks with long and short work
    between meetings (``meeting_cost``), and how much slower the ranks filling the cores compute
    while the others wait (``waiting_slowdown``)."""

    crowd_seconds: float           # with LONG_WORK seconds of work between meetings
    crowd_short_seconds: float     # with SHORT_WORK
    waiting_slowdown: float = 1.0


@dataclass(frozen=True)
class JobCalibration:
    """What the time model takes from the running job: ping-pong (bytes, seconds) points,
    the cost of a meeting of two ranks while the others wait (``pair_seconds``), the torch
    threads of rank 0, the ranks' device (where the planner measures layer times and copy
    speed), what a stage hand-off adds to a relay through every rank (``handoff_seconds``), the
    job's ranks, and its crowded-core rounds (None: not run, the ranks have a core or GPU each)."""

    points: tuple[tuple[int, float], ...]
    pair_seconds: float
    threads: int
    device: str
    handoff_seconds: float = 0.0   # one hand-off in a relay of every rank (``handoff_seconds``)
    ranks: int = 0                 # ranks of the job (the crowd of ``crowded``; 0: not recorded)
    crowded: CrowdedRounds | None = None


def crowded_job(ctx: Comm) -> bool:
    """Whether the job's ranks outnumber the cores they share: a CPU job of more ranks than rank
    0's node has cores (rank 0 decides for all, so every rank runs the same rounds)."""
    from ..comm.waiting import node_cores

    return bool(ctx.bcast_object(ctx.device.type == "cpu" and ctx.world_size > node_cores(), root=0))


def crowded_rounds(ctx: Comm) -> CrowdedRounds:
    """``meeting_cost`` of all ranks with long and short work between meetings, and
    ``waiting_slowdown`` (collective)."""
    crowd = meeting_cost(ctx, work_seconds=LONG_WORK)
    crowd_short = meeting_cost(ctx, work_seconds=SHORT_WORK, rounds=60)
    return CrowdedRounds(crowd, crowd_short, waiting_slowdown(ctx))


def calibrate_job(ctx: Comm) -> JobCalibration:
    """``ping_pong`` + ``meeting_cost`` of two ranks + torch threads + the device +
    ``handoff_seconds`` on the job of ``ctx``, and the crowded rounds when its ranks outnumber
    a CPU node's cores (``crowded_job``; collective)."""
    points = tuple(ping_pong(ctx))
    pair = meeting_cost(ctx, ranks=(0, 1), work_seconds=LONG_WORK) if ctx.world_size > 1 else 0.0
    crowded = crowded_rounds(ctx) if crowded_job(ctx) else None
    threads = int(ctx.bcast_object(torch.get_num_threads(), root=0))
    return JobCalibration(points, pair, threads, str(ctx.device), handoff_seconds(ctx), ctx.world_size, crowded)
