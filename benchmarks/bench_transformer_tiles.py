"""Transformers on 1x2 tiles against one process, forward + backward, timed in alternating turns in one job.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/bench_transformer_tiles.py
    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/bench_transformer_tiles.py --models vit --steps 5 --compare-plain

Models (float32, batch 1, 2 classes, training mode, no dropout or stochastic depth): ``vit``: timm's
``vit_small_patch16_224`` with 4 blocks at 768 px (2,305 tokens: attention spans the two tiles by ring attention);
``swin``: ``swin_tiny_patch4_window7_224`` at 448 px (shifted windows gathered across the seam); the default pair.
Also (``--models``): ``vit-b`` (``vit_base_patch16_224``, 4 blocks, 768 px), ``maxvit`` (``maxvit_tiny_rw_224`` at
448 px: block and grid attention) and ``efficientvit`` (``efficientvit_b1`` at 512 px: linear attention). One
process runs timm's model as it is (its default ``scaled_dot_product_attention``: torch's fused flash kernel for
CPU) on rank 0 while rank 1 sleeps, once with ``--serial-threads`` threads each (default 2 and 1: the machine's two
cores, and one core as a tile has); then both ranks run one process's step at once, one thread each, no exchange
between them (``two processes at once``: what the two cores give two busy processes here, shared caches, memory
bandwidth and other processes' load included; twice one process alone over it is the speed-up two ranks can reach on
this machine). Every run flushes subnormal floats to zero as ``dl.init`` sets a CPU rank (``comm/cpu_floats.py``),
but ``one process, 1 thread, subnormals kept``: timm's model as it runs without mpi4dl-nb (Swin's -100 window mask
makes subnormals: slower). The whole job keeps freed memory in the process as ``dl.init`` sets a CPU rank's malloc
(``comm/allocator.py``: no page faults for each step's new activations and gradients), every variant alike (it is a
setting of the process; ``--malloc default`` leaves glibc's). The tiles run ``dl.spatialize(model, TileGrid(1, 2),
ctx)`` on the two ranks, one thread each, each step ``loss = (y * g).sum()``, backward and ``reduce_tile_gradients``
(the input already scattered).

Turns: every variant runs ``--steps`` steps in turn, ``--turns`` times, after one warm-up step each; a turn's figure
is the median step (a step's time on tiles is the slower rank's), a variant's the median over its turns with the
spread (smallest and largest turn). Speed-up: one process's seconds over the tiles'; the ceiling is 2 (two ranks).
The ranks meet between turns at a barrier that sleeps (``comm.waiting.poll``), so a waiting rank takes no core.
Beside the wall time, each step's process CPU time (``time.process_time``, all its threads): on a machine loaded by
others the wall time of two ranks suffers more than one process's, the CPU time much less; their ratio is the work
split. ``--compare-plain``: the ViT's tiles also with ring attention's blocks on the plain matmul path
(``PlainBlocks``, what CPU ran before issue 67), and every model's tiles also with ``reduce_tile_gradients(net,
overlap=False, shared_memory=False)`` (one all-reduce after backward, as before issue 67), with ``shared_memory=False``
(all-reduce buckets posted during backward from the second step on; the tiles' own step sums through the node's
shared memory) and without ``reduce_tile_gradients`` at all (not a training step: what the gradient sum costs).
``--compare-meetings``: also two processes at once whose ranks meet at a barrier before and after every block's
forward and before its backward (the tiles' many meeting points without their tile work: what synchronising that
often costs on this machine). ``--wait block``: a core per rank, whatever the load the run starts under.

Profile (``--profile``, after the turns): one tile step on rank 0 and one step of one process on one thread under
``torch.profiler``, op by op (self time): what halved and what did not; for ring attention also the seconds in the
ring's block kernels, in its merges and waiting for blocks (the tracer's ``ring_block``/``ring_wait`` spans and a
timed block kernel); then, per tile rank, one step's seconds in the gradient sum and waiting for the peer at the
window exchanges (the tracer's ``window_wait`` spans: Swin, MaxViT). The profiler adds its own time to small ops:
the shares are rough.
"""

from __future__ import annotations

import argparse
import faulthandler
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from support.machine import Footer
from support.tables import Table
from support.world import require_world
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.comm.allocator import tune_malloc
from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.comm.cpu_floats import flush_subnormals
from mpi4dl_nb.comm.waiting import poll
from mpi4dl_nb.spatial.tokens import ring as ring_module
from mpi4dl_nb.spatial.tokens.blocks import BlockKernel, Grads, PlainBlocks, block_kernel


@dataclass(frozen=True)
class Spec:
    title: str
    name: str
    size: int
    settings: dict[str, Any] = field(default_factory=dict)
    sized: bool = True          # built for its image size (img_size=); False: any size runs (EfficientViT)


MODELS = {
    "vit": Spec("ViT-S/16, 4 blocks", "vit_small_patch16_224", 768, {"depth": 4}),
    "swin": Spec("Swin-T", "swin_tiny_patch4_window7_224", 448, {"drop_path_rate": 0.0}),
    "vit-b": Spec("ViT-B/16, 4 blocks", "vit_base_patch16_224", 768, {"depth": 4}),
    "maxvit": Spec("MaxViT-T", "maxvit_tiny_rw_224", 448, {"drop_path_rate": 0.0}),
    "efficientvit": Spec("EfficientViT-B1", "efficientvit_b1", 512, sized=False),
}
TILES, ONE_PROCESS = "tiles", "one process"
PAIR = "two processes at once, 1 thread each (no exchange)"
KEPT = "subnormals kept (timm without dl.init)"
NO_SUM = "tiles without the gradient sum (what it costs)"
MEETING = "two processes at once, meeting 3 times a block (as often as the tiles' exchanges)"


def build(spec: Spec) -> nn.Module:
    import timm

    torch.manual_seed(0)
    sizing = {"img_size": spec.size} if spec.sized else {}
    return timm.create_model(spec.name, num_classes=2, **sizing, **spec.settings).train()


def meeting_at_blocks(model: nn.Module, ctx: Context) -> nn.Module:
    """``model`` with both ranks meeting (a barrier) before and after every block's forward and before its backward:
    one process's whole step on each rank, synchronised about as often as the tiles' token exchanges."""
    for name, module in model.named_modules():
        if name.split(".")[-2:-1] == ["blocks"]:     # a block: "blocks.3", "layers.2.blocks.1"
            module.register_forward_pre_hook(lambda *_: ctx.barrier())
            module.register_forward_hook(lambda *_: ctx.barrier())
            module.register_full_backward_pre_hook(lambda *_: ctx.barrier())
    return model


def sleeping_barrier(ctx: Context) -> None:
    """A barrier whose waiting ranks sleep between tests: a rank waiting for one process's turn takes no core."""
    request = ctx.mpi_comm.Ibarrier()
    poll(request.Test)


class Step:
    """One step: forward, backward and (``tiles``) the tile gradients' sum: through the node's shared memory, else
    overlapped with the backward or after it (``overlap`` None: no sum, what the tiles' own work costs without it).
    ``sum_seconds``: the last step's seconds in ``reduce_tile_gradients``."""

    def __init__(self, model: nn.Module, x: torch.Tensor, weights: torch.Tensor, tiles: bool,
                 overlap: bool | None = True, shared_memory: bool = True) -> None:
        self.model, self.x, self.weights = model, x, weights
        self.summed = tiles and overlap is not None
        self.overlap, self.shared_memory = bool(overlap), shared_memory
        self.sum_seconds = 0.0

    def __call__(self) -> None:
        self.model.zero_grad(set_to_none=True)
        (self.model(self.x) * self.weights).sum().backward()
        if self.summed:
            start = time.perf_counter()
            dl.reduce_tile_gradients(self.model, overlap=self.overlap, shared_memory=self.shared_memory)
            self.sum_seconds = time.perf_counter() - start


@dataclass
class Variant:
    """A configuration timed in turns: its step on this rank (None: this rank sleeps meanwhile) and threads; per
    turn, the median step's wall seconds and its process CPU seconds (the slower rank's each)."""

    label: str
    step: Callable[[], None] | None
    threads: int
    subnormals: bool = False       # kept (the CPU's own handling) instead of flushed, as dl.init sets
    turns: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def run(self, ctx: Context, steps: int) -> tuple[float, float]:
        """Median (wall, CPU) seconds per step of one turn, the slower rank's per step, on every rank."""
        torch.set_num_threads(self.threads)
        if self.subnormals:
            torch.set_flush_denormal(False)
        else:
            flush_subnormals()
        times = []
        for _ in range(steps):
            if self.step is not None:
                if not self.label.startswith(ONE_PROCESS):
                    ctx.barrier()
                start, used = time.perf_counter(), time.process_time()
                self.step()
                times.append((time.perf_counter() - start, time.process_time() - used))
        sleeping_barrier(ctx)
        torch.set_num_threads(1)
        flush_subnormals()          # back to the job's setting (MPI4DL_KEEP_SUBNORMALS=1 respected)
        everyone = [found for found in ctx.all_gather_object(times) if found]
        wall = [max(w for w, _ in per_rank) for per_rank in zip(*everyone)]
        cpu = [max(c for _, c in per_rank) for per_rank in zip(*everyone)]
        return statistics.median(wall), statistics.median(cpu)


@contextmanager
def ring_kernels(choose: Callable[[torch.Tensor], BlockKernel]) -> Iterator[None]:
    """Ring attention's block kernels chosen by ``choose`` (instead of ``block_kernel``) while inside."""
    original = ring_module.block_kernel
    setattr(ring_module, "block_kernel", choose)   # noqa: B010 (a module function, patched for a while)
    try:
        yield
    finally:
        ring_module.block_kernel = original


def with_plain_blocks(step: Callable[[], None]) -> Callable[[], None]:
    def plain_step() -> None:
        with ring_kernels(lambda q: PlainBlocks()):
            step()
    return plain_step


def variants(ctx: Context, spec: Spec, threads: list[int], plain: bool, meetings: bool) -> list[Variant]:
    weights = torch.randn(1, 2, generator=torch.Generator().manual_seed(2))
    x = torch.randn(1, 3, spec.size, spec.size, generator=torch.Generator().manual_seed(1))
    labels = [f"{ONE_PROCESS}, {n} thread{'s' * (n > 1)}" for n in threads]
    serial = Step(build(spec), x, weights, False)
    found = [Variant(label, serial if ctx.rank == 0 else None, n) for label, n in zip(labels, threads)]
    found.append(Variant(f"{ONE_PROCESS}, 1 thread, {KEPT}", serial if ctx.rank == 0 else None, 1, subnormals=True))
    found.append(Variant(PAIR, serial, 1))
    if meetings:
        found.append(Variant(MEETING, Step(meeting_at_blocks(build(spec), ctx), x, weights, False), 1))
    grid = dl.TileGrid(rows=1, cols=2)
    net = dl.spatialize(build(spec), grid, ctx)
    tile = dl.scatter_tiles(x, grid, ctx)
    tiled = Step(net, tile, weights, True)
    if plain and spec.name.startswith("vit"):
        found.append(Variant("tiles, ring blocks by PlainBlocks (before issue 67)", with_plain_blocks(tiled), 1))
    if plain:
        once = Step(dl.spatialize(build(spec), grid, ctx), tile, weights, True, overlap=False, shared_memory=False)
        found.append(Variant("tiles, one all-reduce after backward (before issue 67)", once, 1))
        buckets = Step(dl.spatialize(build(spec), grid, ctx), tile, weights, True, shared_memory=False)
        found.append(Variant("tiles, all-reduce buckets during backward (shared_memory=False)", buckets, 1))
        bare = dl.spatialize(build(spec), grid, ctx)      # its own copy: no reduction armed on it
        found.append(Variant(NO_SUM, Step(bare, tile, weights, True, overlap=None), 1))
    return [*found, Variant(TILES, tiled, 1)]


def timed(ctx: Context, runs: list[Variant], steps: int, turns: int) -> None:
    for variant in runs:                    # warm-up
        variant.run(ctx, 1)
    for _ in range(turns):
        for variant in runs:
            wall, cpu = variant.run(ctx, steps)
            variant.turns.append(wall)
            variant.cpu.append(cpu)


def report(spec: Spec, runs: list[Variant], steps: int) -> None:
    tiles, tiles_cpu = statistics.median(runs[-1].turns), statistics.median(runs[-1].cpu)
    print(f"\n{spec.title} at {spec.size} px (timm {spec.name}), float32, batch 1, forward + backward; "
          f"median of {steps} steps per turn, {len(runs[-1].turns)} alternating turns")
    table = Table(["run", ">s/step (median of turns)", ">spread (turns)", ">tiles speed-up over it", ">of ceiling 2",
                   ">CPU s/step", ">CPU-time ratio"])
    for variant in runs:
        median, cpu = statistics.median(variant.turns), statistics.median(variant.cpu)
        spread = f"{min(variant.turns):.3f}-{max(variant.turns):.3f}"
        speedup = median / tiles
        is_tiles = variant is runs[-1]
        table.add(variant.label + (" (1x2, 1 thread per rank)" if is_tiles else ""), f"{median:.3f}", spread,
                  "" if is_tiles or variant.label in (PAIR, MEETING) else f"{speedup:.2f}x",
                  f"{speedup / 2:.0%}" if variant.label.startswith(ONE_PROCESS) else "", f"{cpu:.3f}",
                  "" if is_tiles else f"{cpu / tiles_cpu:.2f}")
    print(table.markdown(), flush=True)
    alone = next((v for v in runs if v.label.startswith(ONE_PROCESS) and v.threads == 1 and not v.subnormals), None)
    pair = next((v for v in runs if v.label == PAIR), None)
    if alone is not None and pair is not None:
        ceiling = 2 * statistics.median(alone.turns) / statistics.median(pair.turns)
        reached = statistics.median(alone.turns) / tiles
        print(f"the machine's two cores at once: two processes, each one step of the whole model, take "
              f"{statistics.median(pair.turns):.3f} s/step against {statistics.median(alone.turns):.3f} alone: "
              f"{ceiling:.2f}x of one process is what two ranks can reach here (shared memory bandwidth and "
              f"caches, the load of others); the tiles' {reached:.2f}x is {reached / ceiling:.0%} of it", flush=True)
    print("CPU s/step: the process's CPU seconds of the median step (all its threads; tiles: the slower rank's); "
          "their ratio is what the tiles would gain on idle cores without waits (a loaded machine's wall time "
          "is not)", flush=True)


class TimedKernel:
    """The block kernel ring attention would pick, its seconds kept (forward, backward)."""

    seconds = {"forward": 0.0, "backward": 0.0}

    def __init__(self, kernel: BlockKernel) -> None:
        self.kernel = kernel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        found = self.kernel.forward(q, k, v, scale)
        TimedKernel.seconds["forward"] += time.perf_counter() - start
        return found

    def backward(self, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, delta: torch.Tensor, scale: float) -> Grads:
        start = time.perf_counter()
        found = self.kernel.backward(grad, q, k, v, out, lse, delta, scale)
        TimedKernel.seconds["backward"] += time.perf_counter() - start
        return found


def timed_ring_kernels() -> AbstractContextManager[None]:
    """Ring attention's kernels timed (``TimedKernel`` around ``block_kernel``'s choice) while inside."""
    TimedKernel.seconds = {"forward": 0.0, "backward": 0.0}
    return ring_kernels(lambda q: TimedKernel(block_kernel(q)))


def op_times(step: Callable[[], None]) -> tuple[dict[str, float], float]:
    """Self seconds per op of one ``step`` under torch.profiler, and the step's wall seconds."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as found:
        step()
    wall = time.perf_counter() - start
    return {e.key: e.self_cpu_time_total / 1e6 for e in found.key_averages()}, wall


def ring_spans(ctx: Context, since: int) -> dict[str, float]:
    """Seconds of the tracer's ring and window spans recorded since ``recorded`` was ``since``: block compute and
    waits, by pass (``ring_block forward``, ``ring_wait gradient``, ``window_wait backward``, ...)."""
    totals: dict[str, float] = {}
    for event in ctx.tracer.since(since):
        if event.op in ("ring_block", "ring_wait", "window_wait"):
            key = f"{event.op} {event.extra.get('what', '')}"
            totals[key] = totals.get(key, 0.0) + event.duration
    return totals


def profile_rows(ctx: Context, spec: Spec, runs: list[Variant], top: int) -> None:
    """One tile step on every rank (rank 0's ops shown) beside one step of one process on one thread."""
    serial = next((v for v in runs if v.threads == 1 and v.label.startswith(ONE_PROCESS) and not v.subnormals), None)
    serial_ops: dict[str, float] = {}
    serial_wall = float("nan")
    if ctx.rank == 0 and serial is not None and serial.step is not None:
        torch.set_num_threads(1)
        serial_ops, serial_wall = op_times(serial.step)
    sleeping_barrier(ctx)
    tiles = runs[-1]
    assert tiles.step is not None
    ctx.barrier()
    with timed_ring_kernels():
        tile_ops, tile_wall = op_times(tiles.step)
        kernels = dict(TimedKernel.seconds)
    ctx.barrier()
    with timed_ring_kernels():                 # again without the profiler: the ring's own seconds
        ctx.tracer.configure(window_steps=None, max_events=None)
        mark = ctx.tracer.recorded
        start = time.perf_counter()
        tiles.step()
        plain_wall = time.perf_counter() - start
        spans, kernels_plain = ring_spans(ctx, mark), dict(TimedKernel.seconds)
    sleeping_barrier(ctx)
    sum_seconds = tiles.step.sum_seconds if isinstance(tiles.step, Step) else float("nan")
    ranks = ctx.all_gather_object((plain_wall, spans, sum_seconds))
    if ctx.rank != 0:
        return
    print(f"\nprofile, {spec.title}: one step, op self seconds (torch.profiler; rank 0 of the tiles, one thread "
          f"each): one process {serial_wall:.3f} s wall, tile rank {tile_wall:.3f} s wall")
    table = Table(["op", ">one process (1 thread) s", ">tile rank s", ">tile / one process"])
    names = sorted(set(serial_ops) | set(tile_ops), key=lambda n: -max(tile_ops.get(n, 0.0),
                                                                         serial_ops.get(n, 0.0) / 2))
    for name in names[:top]:
        one, tile = serial_ops.get(name, 0.0), tile_ops.get(name, 0.0)
        table.add(name, f"{one:.3f}", f"{tile:.3f}", f"{tile / one:.2f}" if one else "-")
    rest_one = sum(serial_ops.get(n, 0.0) for n in names[top:])
    rest_tile = sum(tile_ops.get(n, 0.0) for n in names[top:])
    table.add("(other ops)", f"{rest_one:.3f}", f"{rest_tile:.3f}", f"{rest_tile / rest_one:.2f}" if rest_one else "-")
    table.add("(wall not in ops: Python, waits)", f"{serial_wall - sum(serial_ops.values()):.3f}",
              f"{tile_wall - sum(tile_ops.values()):.3f}", "")
    print(table.markdown())
    if kernels_plain["forward"] or kernels_plain["backward"]:
        merges = spans.get("ring_block forward", 0.0) - kernels_plain["forward"]
        around = spans.get("ring_block backward", 0.0) - kernels_plain["backward"]
        waits = {k.split()[-1]: v for k, v in spans.items() if k.startswith("ring_wait")}
        print(f"\nring attention on tile rank 0, one step without the profiler ({plain_wall:.3f} s): block kernels "
              f"forward {kernels_plain['forward']:.3f} s, backward {kernels_plain['backward']:.3f} s; merges "
              f"{merges:.3f} s (forward blocks' spans less their kernels), backward blocks' spans less their kernels "
              f"{around:.3f} s; waiting for " + ", ".join(f"{k} {v:.3f} s" for k, v in waits.items())
              + f"; under the profiler the kernels took {kernels['forward'] + kernels['backward']:.3f} s", flush=True)
    print("\nwhere each tile rank waits, one step without the profiler: " + "; ".join(
        f"rank {rank} {wall:.3f} s, the gradient sum {summed:.3f} s"
        + "".join(f", waiting at the window exchanges {what.split()[-1]} {seconds:.3f} s"
                  for what, seconds in sorted(found.items(), reverse=True) if what.startswith("window_wait"))
        for rank, (wall, found, summed) in enumerate(ranks))
        + " (a rank waits at an exchange for the slower one: on equal cores and equal work, jitter; when one rank "
          "waits much longer than the other, the other ran slower, by its core or its work: bind the ranks either "
          "way round, mpiexec -bind-to user:0,1 or user:1,0, to tell which)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vit,swin", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--steps", type=int, default=3, help="steps per turn (their median is the turn's)")
    parser.add_argument("--turns", type=int, default=3, help="alternating turns of every variant")
    parser.add_argument("--serial-threads", default="2,1", help="threads of one process, one variant each")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--top", type=int, default=12, help="ops shown in the profile")
    parser.add_argument("--size", type=int, default=None, help="every model's image size (px) instead of its own")
    parser.add_argument("--compare-plain", action="store_true",
                        help="ViT: also time the tiles with ring attention's blocks on the plain matmul path")
    parser.add_argument("--compare-meetings", action="store_true",
                        help="also time two processes at once whose ranks meet 3 times a block: the tiles' many "
                             "meeting points without their tile work")
    parser.add_argument("--wait", choices=("auto", "block", "yield"), default="auto",
                        help="how ranks wait for MPI (comm/waiting.py); auto yields at a 1-minute load of 2 or more, "
                             "which a run started right after another inherits from it: block = a core per rank")
    parser.add_argument("--malloc", choices=("tuned", "default"), default="tuned",
                        help="tuned: freed memory kept in the process, as dl.init sets a CPU rank (comm/allocator.py); "
                             "default: glibc's own (big blocks unmapped when freed, page faults each step)")
    args = parser.parse_args()
    footer = Footer()
    torch.set_num_threads(1)
    flush_subnormals()          # as dl.init sets a CPU rank (comm/cpu_floats.py); one variant keeps them
    if args.malloc == "tuned":
        tune_malloc()           # as dl.init sets a CPU rank (comm/allocator.py): the whole process, every variant
    ctx = Context(wait=args.wait)
    require_world(ctx, 2, "bench_transformer_tiles")
    threads = [int(n) for n in args.serial_threads.split(",") if n]
    if ctx.rank == 0:
        kernel = block_kernel(torch.zeros(1, 1, 1, 1))
        ops = getattr(kernel, "ops", None)
        print(f"ring attention's blocks on CPU in float32: {type(kernel).__name__}"
              f"{f' ({ops.name})' if ops is not None else ''}; MPI wait mode {ctx.wait_mode}", flush=True)
    for key in args.models.split(","):
        spec = MODELS[key] if args.size is None else replace(MODELS[key], size=args.size)
        runs = variants(ctx, spec, threads, args.compare_plain, args.compare_meetings)
        timed(ctx, runs, args.steps, args.turns)
        if ctx.rank == 0:
            report(spec, runs, args.steps)
        if args.profile:
            profile_rows(ctx, spec, runs, args.top)
        del runs
    if ctx.rank == 0:
        footer.print()


if __name__ == "__main__":
    faulthandler.enable()
    main()
