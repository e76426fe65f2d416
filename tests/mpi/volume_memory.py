"""MPI: activation bytes per rank of a 3-D conv stack's training step on P = 2, 4, 8 tiles <= 1.15/P of one process.

Usage: python -m tests.mpi.volume_memory (8 ranks, one launch). The bytes autograd keeps (``ActivationMeter``,
each storage once) during one forward + backward, float64, of ``benchmarks/support/volume_memory.py``'s conv
stack on a 40^3 volume: one process on rank 0, then each P on ranks 0..P-1 (2x1x1, 2x2x1, 2x2x2). Named checks:
``conv stack P=2``, ``P=4``, ``P=8`` (the largest rank's bytes over one process's, against the bound), ``pool
stack P=8`` (the same for a conv, ReLU, MaxPool3d and AvgPool3d with halos, on 2x2x2: the pools keep no needed
tile), and
``steps leave nothing behind``: five training steps of the stack on the 2x2x2 grid (a 16^3 volume) leave every rank
the same live tensor bytes and the same number of objects the garbage collector tracks after each step from the
second on (no halo buffer, strip list, exchange or autograd graph piles up: the processes' RSS growth measured in
``benchmarks/bench_volume_memory.py`` is glibc's, docs/spatial.md "Volumes").
"""

from __future__ import annotations

import copy
import gc

import torch

import mpi4dl_nb as dl
from benchmarks.support.volume_memory import BOUND, GRIDS, conv_stack3d, measure, tile_of
from mpi4dl_nb.comm.protocol import Comm
from mpi4dl_nb.measure.usage import live_tensor_bytes
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.support.checks import Checks, run_checks

WORLD = 8
SIDE = 40          # 20^3 voxels a tile on 2x2x2: the one-voxel halo shells add ~10% to the saved bytes
FLAT = "steps leave nothing behind"
POOLS = "pool stack P=8"
CHECKS = [f"conv stack P={parts}" for parts in GRIDS] + [POOLS, FLAT]
STEPS = 3


def pool_stack() -> list[torch.nn.Module]:
    """A conv and ReLU, then the 3-D pools with a halo: max and average, 3^3 windows of stride 1 (padding 1)."""
    torch.manual_seed(0)
    return [torch.nn.Conv3d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool3d(3, 1, 1),
            torch.nn.AvgPool3d(3, 1, 1)]


def after_each_step(ctx: Comm) -> list[tuple[int, int]]:
    """(live tensor bytes, objects gc tracks) on this rank after each of ``STEPS`` training steps of the conv stack
    on the 2x2x2 grid (SGD, so the weights change; the first scan itself makes objects: taken before step 1)."""
    grid = TileGrid.of_shape(GRIDS[8])
    net = spatialize(copy.deepcopy(torch.nn.Sequential(*stack()).double()), grid, ctx)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    volume = torch.rand(1, 1, 16, 16, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x = tile_of(volume, grid, ctx.rank)
    live_tensor_bytes()
    found = []
    # halo exchanges are traced (as on images): the trace keeps a bounded window of events (outside the engine's
    # steps up to its max_events), by design and apart from the spatial machinery this check is about
    tracing, ctx.tracer.enabled = ctx.tracer.enabled, False
    try:
        for _ in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            net(x).sum().backward()
            optimizer.step()
            gc.collect()
            found.append((live_tensor_bytes(), len(gc.get_objects())))
    finally:
        ctx.tracer.enabled = tracing
    return found


def stack() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return conv_stack3d(channels=4, convs=4)


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    volume = torch.rand(1, 1, SIDE, SIDE, SIDE, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    measured = ctx.bcast_object(measure(ctx, stack, volume, tuple(GRIDS)), root=0)
    for parts, name in zip(GRIDS, CHECKS):
        with check(name) as result:
            assert measured is not None and len(measured.tiles[parts]) == parts
            assert min(measured.tiles[parts]) > 0, f"a rank measured nothing: {measured.tiles[parts]}"
            ratio = measured.ratio(parts)
            result.detail = f"ratio {ratio:.4f}, bound {BOUND / parts:.4f} (ideal {1 / parts:.4f})"
            assert ratio <= BOUND / parts, f"largest rank {ratio:.4f} of one process > {BOUND}/{parts}"
    pools = ctx.bcast_object(measure(ctx, pool_stack, volume, (8,)), root=0)
    with check(POOLS) as result:
        assert pools is not None and min(pools.tiles[8]) > 0, "a rank measured nothing"
        ratio = pools.ratio(8)
        result.detail = f"ratio {ratio:.4f}, bound {BOUND / 8:.4f} (ideal {1 / 8:.4f})"
        assert ratio <= BOUND / 8, f"largest rank {ratio:.4f} of one process > {BOUND}/8"
    with check(FLAT) as result:
        found = after_each_step(ctx)
        result.detail = f"after steps 1-{STEPS}: (live tensor bytes, gc objects) {found}"
        assert found[0][0] > 0, "no tensor seen: the scan counts nothing"
        # nothing piles up: neither count grows after step 2 (gc's may fall as a first step's caches settle)
        assert all(later[0] == found[1][0] and later[1] <= found[1][1] for later in found[2:]), \
            f"grew from step 2 on: {found}"
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
