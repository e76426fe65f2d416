"""The engine's own cost per action beside torch.distributed.pipelining's, on layers that do almost nothing.

Run (2 ranks; every figure of one run comes from one job, both sides timed in turns)::

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/bench_actions.py
    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/bench_actions.py --profile 40   # + cProfile of ours

Each schedule (1f1b, interleaved with V = 2, zb1, zbv) runs on S x V stages of one ``Linear(16, 16)`` each
(the last one's output is the 16-class logits) with ``--batch`` rows cut into ``--micro-batches`` micro-batches:
the compute is a few microseconds, so what is measured is what each runtime does around it. Per schedule:
microseconds per step (``--steps`` steps per call, calls in turns, median over ``--rounds`` rounds; slowest
rank) and microseconds per action kind, the largest rank's median call over the timed rounds
(forward ``F``, full backward ``B``, input half ``I``, weight half ``W``, ``send``: posting an activation or
gradient, ``recv``: taking one, waiting included). Ours: this rank's ``PipelineRuntime`` actions; the peer's:
its stages' ``forward_one_chunk`` (with the loss it computes after a last stage's forward: ours computes it
inside the forward action) / ``backward_one_chunk`` (full or input half) /
``backward_weight_one_chunk``, its ``_batch_p2p`` posts and ``_wait_batch_p2p`` waits: a post of sends is a
``send``, a wait with a receive among its works a ``recv`` (the post of those receives added to it), another wait a
``send``. ``peer/ours`` > 1: ours costs less.
A receive's figure includes waiting for the other rank (not only cost). ``--clock cpu`` times each action by this
thread's CPU time instead (on a loaded machine the time spent waiting for a core drops out; a gloo peer's work on
its own threads does too, so its send/recv figures are then too low). ``--profile N`` then runs N more steps
of each of our schedules under cProfile on rank 0 and prints the top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from bench_pipeline import NEW_SCHEDULES, VIRTUAL, new_schedule_config, peer_refusal, peer_runner, peer_stages
from support.machine import Footer
from support.tables import Table
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.comm.context import Context

WIDTH = 16
KINDS = ("F", "B", "I", "W", "send", "recv")
Counter = dict[str, list[float]]   # kind -> each call's seconds
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def tiny_layers(count: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Linear(WIDTH, WIDTH) for _ in range(count)]


def tiny_batch(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(batch, WIDTH, generator=gen), torch.randint(0, WIDTH, (batch,), generator=gen)


class KindTimer:
    """Seconds and calls per action kind while ``on``; wrappers add the same two clock reads on both sides."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.on = False
        self.counts: Counter = defaultdict(list)
        self.stash: dict[str, float] = {}

    def timed(self, kind_of: Callable[..., str], call: Callable[..., object]) -> Callable[..., object]:
        def wrapper(*args: object, **kwargs: object) -> object:
            if not self.on:
                return call(*args, **kwargs)
            start = self.clock()
            try:
                return call(*args, **kwargs)
            finally:
                self.add(kind_of(*args, **kwargs), self.clock() - start)
        return wrapper

    def add(self, kind: str, took: float) -> None:
        """``took`` seconds of ``kind``; ``+F``: part of the last F, ``>recv``: part of the next recv."""
        if kind.startswith(">"):
            self.stash[kind[1:]] = self.stash.get(kind[1:], 0.0) + took
        elif kind.startswith("+") and self.counts[kind[1:]]:
            self.counts[kind[1:]][-1] += took
        else:
            self.counts[kind.lstrip("+")].append(took + self.stash.pop(kind, 0.0))

    @contextmanager
    def counting(self) -> Iterator[Counter]:
        self.counts, self.stash = defaultdict(list), {}
        self.on = True
        try:
            yield self.counts
        finally:
            self.on = False


OUR_KINDS = {"F": "F", "B": "B", "I": "I", "W": "W", "SEND_ACT": "send", "SEND_GRAD": "send",
             "RECV_ACT": "recv", "RECV_GRAD": "recv", "ALLREDUCE": "AR", "OPTIM": "OPT"}


def make_ours(ctx, schedule: str, m: int, args, timer: KindTimer) -> tuple[Callable[[], None], object]:
    cfg = new_schedule_config(schedule, ctx.world_size, m)
    layers = tiny_layers(cfg.split_size)
    cfg = cfg.with_(balance=(1,) * cfg.split_size)
    engine = dl.HybridEngine(layers, cfg, ctx, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    runtime = engine.runtime
    runtime._run = {kind: timer.timed(lambda action, state, name=OUR_KINDS[kind.value]: name, run)   # its kind table
                    for kind, run in runtime._run.items()}
    x, y = tiny_batch(args.batch)

    def steps() -> None:
        for _ in range(args.steps):
            engine.train_step(x, y)
    return steps, engine


def _p2p_kind(ops) -> str:
    import torch.distributed as dist
    return "recv" if any(op.op is dist.irecv for op in ops) else "send"


def instrument_peer(timer: KindTimer) -> None:
    """Wrap the peer's stage methods and p2p posts/waits (module-level functions, looked up at call time)."""
    from torch.distributed.pipelining import schedules, stage

    kinds: dict[int, str] = {}
    post = schedules._batch_p2p

    def batch_p2p(ops, desc=None):
        works = post(ops, desc)
        for work in works:
            kinds[id(work)] = _p2p_kind(ops)
        return works
    schedules._batch_p2p = timer.timed(lambda ops, desc=None: ">" + _p2p_kind(ops) if _p2p_kind(ops) == "recv"
                                       else "send", batch_p2p)
    schedules._wait_batch_p2p = timer.timed(
        lambda works: "recv" if any(kinds.pop(id(w), "send") == "recv" for w in list(works)) else "send",
        schedules._wait_batch_p2p)
    # its loss runs after the last stage's forward_one_chunk (ours inside the forward action): counted in that F
    schedules._PipelineSchedule._maybe_compute_loss = timer.timed(lambda *a, **k: "+F",
                                                                  schedules._PipelineSchedule._maybe_compute_loss)
    cls = stage._PipelineStageBase
    cls.forward_one_chunk = timer.timed(lambda *a, **k: "F", cls.forward_one_chunk)
    cls.backward_one_chunk = timer.timed(lambda *a, **k: "B" if k.get("full_backward", True) else "I",
                                         cls.backward_one_chunk)
    cls.backward_weight_one_chunk = timer.timed(lambda *a, **k: "W", cls.backward_weight_one_chunk)


def make_peer(schedule: str, m: int, args) -> Callable[[], None]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    rank, ranks = dist.get_rank(), dist.get_world_size()
    count = ranks * VIRTUAL[schedule]
    layers = tiny_layers(count)
    mine = peer_stages(schedule, rank, ranks)
    stages = [PipelineStage(layers[i], i, count, torch.device("cpu")) for i in mine]
    runner = peer_runner(schedule, stages, m)
    opt = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=0.01)
    x, y = tiny_batch(args.batch)
    inputs = (x,) if 0 in mine else ()
    target = {"target": y} if count - 1 in mine else {}

    def steps() -> None:
        for _ in range(args.steps):
            opt.zero_grad()
            runner.step(*inputs, **target)
            opt.step()
    return steps


def timed_rounds(ctx, runs: dict[str, Callable[[], None]], rounds: int, timer: KindTimer | None
                 ) -> tuple[dict[str, list[float]], dict[str, list[Counter]]]:
    """Per run: each round's seconds per call (slowest rank), and with a timer each round's counts per rank."""
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    counts: dict[str, list[Counter]] = {name: [] for name in runs}
    for index in range(rounds + 1):
        for name, run in runs.items():
            ctx.barrier()
            start = time.perf_counter()
            if timer is None:
                run()
                found: Counter = {}
            else:
                with timer.counting() as found:
                    run()
            took = time.perf_counter() - start
            took = max(ctx.all_gather_object(took))
            gathered = ctx.all_gather_object(dict(found))
            if index:
                seconds[name].append(took)
                counts[name].extend(gathered)
    return seconds, counts


def per_action_us(counts: list[Counter], ranks: int, kind: str) -> float | None:
    """The largest rank's median microseconds per action of ``kind`` over every timed round (``counts``: per
    round, per rank in rank order)."""
    per_rank = [[t for c in counts[rank::ranks] for t in c.get(kind, [])] for rank in range(ranks)]
    medians = [statistics.median(times) * 1e6 for times in per_rank if times]
    return max(medians) if medians else None


def ratio_cell(peer: float | None, ours: float | None) -> str:
    return f"{peer / ours:.2f}" if peer is not None and ours else "-"


def report(args, step_times: dict[str, list[float]], counts: dict[str, list[Counter]], schedules: list[str],
           notes: list[str]) -> None:
    table = Table(["schedule", "what", ">ours us", ">peer us", ">peer/ours", ">ours spread", ">peer spread"])
    for schedule in schedules:
        ours, peer = step_times.get(f"ours {schedule}"), step_times.get(f"peer {schedule}")
        us = {side: (statistics.median(t) / args.steps * 1e6 if t else None) for side, t in (("o", ours), ("p", peer))}
        spread = {side: (f"{min(t) / args.steps * 1e6:.0f}-{max(t) / args.steps * 1e6:.0f}" if t else "-")
                  for side, t in (("o", ours), ("p", peer))}
        table.add(schedule, "step", f"{us['o']:.0f}" if us["o"] else "-", f"{us['p']:.0f}" if us["p"] else "-",
                  ratio_cell(us["p"], us["o"]), spread["o"], spread["p"])
        for kind in KINDS:
            mine = per_action_us(counts.get(f"ours {schedule}", []), args.ranks, kind)
            theirs = per_action_us(counts.get(f"peer {schedule}", []), args.ranks, kind)
            if mine is None and theirs is None:
                continue
            table.add(schedule, kind, f"{mine:.0f}" if mine is not None else "-",
                      f"{theirs:.0f}" if theirs is not None else "-", ratio_cell(theirs, mine), "", "")
    print(f"# per-action cost, S = {args.ranks} ranks, Linear({WIDTH}, {WIDTH}) per stage, batch {args.batch}, "
          f"m = {args.micro_batches}, {args.steps} steps per call, {args.rounds} rounds in turns, "
          f"{args.clock} clock per action (steps: wall)")
    print(table.markdown())
    for note in notes:
        print(f"- {note}")


def profile_ours(runs: dict[str, Callable[[], None]], top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for name, run in runs.items():
        if name.startswith("ours"):
            run()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--schedules", default=",".join(NEW_SCHEDULES))
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--profile", type=int, default=0, help="steps per schedule under cProfile (0: none)")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="per-action clock: wall (perf_counter) or cpu (this thread's CPU time: what a loaded "
                             "machine's waiting for a core leaves out; a gloo peer's work on its own threads too)")
    args = parser.parse_args()
    footer = Footer()
    torch.set_num_threads(1)
    ctx = dl.init()
    plane = None if args.no_peer else Context(backend="gloo", trace=False)
    args.ranks = ctx.world_size
    schedules = [s for s in args.schedules.split(",") if s]
    timer = KindTimer(CLOCKS[args.clock])
    if not args.no_peer:
        instrument_peer(timer)
    runs: dict[str, Callable[[], None]] = {}
    notes = []
    for schedule in schedules:
        runs[f"ours {schedule}"] = make_ours(ctx, schedule, args.micro_batches, args, timer)[0]
        refused = None if args.no_peer else peer_refusal(schedule, ctx.world_size, args.micro_batches, args.batch)
        if args.no_peer or refused:
            notes.append(refused or "peer left out (--no-peer)")
        else:
            runs[f"peer {schedule}"] = make_peer(schedule, args.micro_batches, args)
    step_times, _ = timed_rounds(ctx, runs, args.rounds, None)
    _, counts = timed_rounds(ctx, runs, args.rounds, timer)
    if ctx.rank == 0:
        report(args, step_times, counts, schedules, notes)
    if args.profile:
        args.steps = args.profile
        text = profile_ours({name: run for name, run in runs.items() if name.startswith("ours")}, args.top)
        if ctx.rank == 0:
            print(f"\n## cProfile of ours, rank 0, {args.profile} steps of each schedule (top {args.top} by own time)")
            print("```\n" + text.strip() + "\n```")
    ctx.tracer.clear()
    if ctx.rank == 0:
        footer.print()
    ctx.barrier()
    if plane is not None:
        plane.close()


if __name__ == "__main__":
    main()
