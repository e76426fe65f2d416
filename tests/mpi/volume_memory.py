"""MPI: activation bytes per rank of a 3-D conv stack's training step on P = 2, 4, 8 tiles <= 1.15/P of one process.

Usage: python -m tests.mpi.volume_memory (8 ranks, one launch). The bytes autograd keeps (``ActivationMeter``,
each storage once) during one forward + backward, float64, of ``benchmarks/support/volume_memory.py``'s conv
stack on a 40^3 volume: one process on rank 0, then each P on ranks 0..P-1 (2x1x1, 2x2x1, 2x2x2). Named checks:
``conv stack P=2``, ``P=4``, ``P=8`` (the largest rank's bytes over one process's, against the bound).
"""

from __future__ import annotations

import torch

import mpi4dl_nb as dl
from benchmarks.support.volume_memory import BOUND, GRIDS, conv_stack3d, measure
from tests.support.checks import Checks, run_checks

WORLD = 8
SIDE = 40          # 20^3 voxels a tile on 2x2x2: the one-voxel halo shells add ~10% to the saved bytes
CHECKS = [f"conv stack P={parts}" for parts in GRIDS]


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
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
