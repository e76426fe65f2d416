"""Cost of exactness: the op guard on a ResNet step, and SE-ResNet / U-Net on 1, 2 and 4 tiles.

    OMP_NUM_THREADS=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 \\
        mpiexec -n 2 python benchmarks/bench_correctness.py guard --size 256 --steps 3 --rounds 3
    OMP_NUM_THREADS=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 MPIR_CVAR_ENABLE_HEAVY_YIELD=1 \\
        mpiexec -n 4 python benchmarks/bench_correctness.py models --size 256 --steps 2 --rounds 2

guard: a ResNet-20 v1 (width 16, classifier included: global pool + Linear on the replicated
pooled value) spatialized on 2 tiles (vertical cuts), batch 2, float32, forward + backward +
tile-gradient sum. Rounds alternate, side by side in one run: (A) no guard (placement tracking
off: only to measure, SE gates would then be wrong), (B) ``check_ops=False`` (tracking only),
(C) the default guard (tracking + per-op checks). Prints best seconds/step, the overhead of B
and C over A (goal: C under 3%) and how many torch operations the mode saw per forward.

models: SE-ResNet (3 SE blocks, width x4) and a two-level U-Net (transposed conv + bilinear
up-sampling + skip concatenation, width x4) with a per-pixel loss on tiles, on 1 tile (rank 0
alone), 2 tiles (1x2) and 4 tiles (2x2) in one run: best seconds/step (slowest rank) and peak
activation bytes per rank (saved for backward, ``measure.usage.ActivationMeter``), with ratios
to the 1-tile run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from support.dense_models import Sequence, se_resnet_layers, unet_layers
from support.machine import Footer
from support.tables import Table
from support.timing import best_of
from support.world import require_world
from torch import nn

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.loss import tile_mean
from mpi4dl_nb.measure.usage import ActivationMeter
from mpi4dl_nb.models import resnet
from mpi4dl_nb.spatial.convert import reduce_tile_gradients, runtime_of, spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.guard import SpatialGuard
from mpi4dl_nb.spatial.tiles import scatter_tiles


def op_overhead(checker: SpatialGuard, repeats: int = 5000) -> float:
    """Seconds the guard adds to one point-wise op on a tile (mode dispatch + checks + marking)."""
    x = torch.ones(1, 1, 1, 1)
    plain = best_of(lambda: [x + 1 for _ in range(repeats)], 5)
    checker.begin((x,))
    try:
        guarded = best_of(lambda: [x + 1 for _ in range(repeats)], 5)
    finally:
        checker.end()
    return max(0.0, guarded - plain) / repeats


def guard(ctx: Context, size: int, steps: int, rounds: int) -> None:
    require_world(ctx, 2, "guard")
    grid = TileGrid(1, 2)
    torch.manual_seed(0)
    image = torch.randn(2, 3, size, size)
    labels = torch.randint(0, 10, (2,))
    variants = {}
    for key, check, enabled in (("A", True, False), ("B", False, True), ("C", True, True)):
        model = nn.Sequential(*resnet(20, 10, version=1, width=16))
        net = spatialize(model, grid, ctx, image_size=(size, size), check_ops=check)
        runtime_of(net).guard.enabled = enabled
        variants[key] = net
    tile = scatter_tiles(image, grid, ctx)

    def step(net: nn.Module) -> Callable[[], None]:
        def run() -> None:
            net.zero_grad(set_to_none=True)
            F.cross_entropy(net(tile), labels).backward()
            reduce_tile_gradients(net)
        return run

    for net in variants.values():   # warm-up: geometry caches, allocator
        step(net)()
    best = {key: float("inf") for key in variants}
    for _ in range(rounds):
        for key, net in variants.items():
            ctx.barrier()
            best[key] = min(best[key], best_of(step(net), steps))
    checker = runtime_of(variants["C"]).guard
    seen = checker.ops_seen
    per_op = op_overhead(checker)
    slowest = ctx.all_gather_object([best[k] for k in "ABC"])
    if ctx.rank == 0:
        a, b, c = (max(r[i] for r in slowest) for i in range(3))
        print(f"direct estimate: {seen} ops x {per_op * 1e6:.1f} us (guard cost of one checked op on a "
              f"tile, measured on a 1-element add) = {seen * per_op * 1e3:.2f} ms per forward = "
              f"{100 * seen * per_op / a:.3f}% of A's step")
        print(f"ResNet-20 v1 width 16 + classifier, {size}x{size}, batch 2, 2 tiles (1x2), fwd+bwd, "
              f"best of {rounds}x{steps} steps; the mode saw {seen} torch ops per forward")
        table = Table(["run", ">seconds/step", ">overhead vs A"])
        table.add("A: no guard (measurement only)", f"{a:.4f}", "-")
        table.add("B: check_ops=False (placement tracking)", f"{b:.4f}", f"{100 * (b / a - 1):+.2f}%")
        table.add("C: default guard (tracking + op checks)", f"{c:.4f}", f"{100 * (c / a - 1):+.2f}%")
        print(table.markdown())


def _model_step(name: str, net: nn.Module, tile: torch.Tensor, target: torch.Tensor,
                meter: ActivationMeter) -> Callable[[], None]:
    def run() -> None:
        net.zero_grad(set_to_none=True)
        with meter:
            out = net(tile)
        if name == "U-Net":
            loss = tile_mean(F.cross_entropy(out, target, reduction="none"), net)
        else:
            loss = F.cross_entropy(out, target)
        loss.backward()
        reduce_tile_gradients(net)
    return run


def models(ctx: Context, size: int, steps: int, rounds: int) -> None:
    require_world(ctx, 4, "models", at_least=True)
    torch.manual_seed(0)
    image = torch.randn(2, 3, size, size)
    builders = {"SE-ResNet": (lambda: Sequence(se_resnet_layers(width=4)), torch.randint(0, 5, (2,))),
                "U-Net": (lambda: Sequence(unet_layers(width=4)), torch.randint(0, 3, (2, size, size)))}
    grids = {1: TileGrid(1, 1), 2: TileGrid(1, 2), 4: TileGrid(2, 2)}
    groups = {p: ctx.new_group(range(p)) for p in grids}
    results: dict[tuple[str, int], tuple[float, int]] = {}
    for name, (build, target) in builders.items():
        for parts, grid in grids.items():
            if ctx.rank < parts:
                net = spatialize(build(), grid, ctx, groups[parts], image_size=(size, size))
                tile = scatter_tiles(image, grid, ctx, groups[parts])
                tiled_target = scatter_tiles(target, grid, ctx, groups[parts]) if target.dim() == 3 else target
                meter = ActivationMeter(exclude=net.parameters())
                run = _model_step(name, net, tile, tiled_target, meter)
                run()   # warm-up
                meter.peak = meter.current
                seconds = min(best_of(run, steps) for _ in range(rounds))
                results[(name, parts)] = (seconds, meter.peak)
            ctx.barrier()
    gathered = ctx.all_gather_object(results)
    if ctx.rank == 0:
        print(f"{size}x{size}, batch 2, float32, fwd+bwd (+ per-pixel loss on tiles for U-Net), "
              f"best of {rounds}x{steps} steps; slowest rank's time, largest rank's activations")
        table = Table(["model", ">tiles", ">seconds/step", ">speed-up vs 1 tile", ">activation MiB/rank",
                       ">ratio vs 1 tile"])
        for name in builders:
            base_t = gathered[0][(name, 1)][0]
            base_m = gathered[0][(name, 1)][1]
            for parts in grids:
                t = max(gathered[r][(name, parts)][0] for r in range(parts))
                m = max(gathered[r][(name, parts)][1] for r in range(parts))
                table.add(name, parts, f"{t:.3f}", f"{base_t / t:.2f}", f"{m / 2**20:.1f}", f"{m / base_m:.3f}")
        print(table.markdown())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["guard", "models"])
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    footer = Footer()
    torch.set_num_threads(1)
    ctx = Context(trace=False)
    (guard if args.what == "guard" else models)(ctx, args.size, args.steps, args.rounds)
    if ctx.rank == 0:
        footer.print()


if __name__ == "__main__":
    main()
