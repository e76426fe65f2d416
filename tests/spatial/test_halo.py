"""Halo exchange: adjoint test, forward against padded slices, buffer reuse, sub-groups, both planes."""

from __future__ import annotations

import pytest
import torch

from tests.mpi import halo_adjoint, halo_fused
from tests.support.battery import shared_job

# 3x3: both planes in one launch, the whole world; 2x2: with an idle rank beside the grid (a sub-group).
CASES = [(3, 3, "mpi,gloo", 0), (2, 2, "mpi", 1)]
ADJOINT = {case: shared_job(case[0] * case[1] + case[3], "halo_adjoint", *case) for case in CASES}
FUSED = {grid: shared_job(grid[0] * grid[1], "halo_fused", *grid) for grid in [(3, 3), (1, 4)]}


@pytest.mark.parametrize("rows,cols,backends,idle", CASES,
                         ids=[f"{r}x{c}-{b.replace(',', '+')}-idle{i}" for r, c, b, i in CASES])
def test_halo_adjoint_and_forward(shared_launch, rows, cols, backends, idle):
    shared_launch(ADJOINT[(rows, cols, backends, idle)]).require_clean(halo_adjoint.check_names(backends))


def test_buffer_pool_reuses_by_shape():
    from mpi4dl_nb.spatial.halo import BufferPool

    pool = BufferPool()
    like = torch.zeros(1, dtype=torch.float64)
    a = pool.get("r", (2, 3), like)
    assert pool.get("r", (2, 3), like) is a
    assert pool.get("r", (3, 2), like) is not a and pool.get("s", (2, 3), like) is not a
    assert pool.nbytes == 3 * 6 * 8


@pytest.mark.parametrize("rows,cols", list(FUSED), ids=["3x3", "1x4"])
def test_fused_halos_equal_unfused_and_serial(shared_launch, rows, cols):
    shared_launch(FUSED[(rows, cols)]).require_clean(halo_fused.check_names())


def test_fused_blocks_group_windowed_layers():
    from torch import nn

    from mpi4dl_nb.spatial.convert import spatialize
    from mpi4dl_nb.spatial.fused import FusedSequential
    from mpi4dl_nb.spatial.geometry import TileGrid

    class FakeCtx:
        rank, world_size = 0, 1

    seq = nn.Sequential(nn.ReLU(), nn.Conv2d(1, 1, 3), nn.BatchNorm2d(1), nn.ReLU(),
                        nn.Conv2d(1, 1, 3), nn.MaxPool2d(2), nn.Conv2d(1, 1, 1),
                        nn.AdaptiveAvgPool2d(1), nn.Conv2d(1, 1, 3), nn.Conv2d(1, 1, 3))

    def blocks(fused_layers: int) -> list[tuple[int, int]]:
        net = spatialize(seq, TileGrid(1, 1), FakeCtx(), halo_d2=True, fused_layers=fused_layers)
        if not isinstance(net, FusedSequential):
            return []
        return [(block.start, block.stop) for block in net.fused_blocks.values()]
    assert blocks(2) == [(1, 5), (5, 7), (8, 10)]
    assert blocks(3) == [(1, 6), (8, 10)]
    assert blocks(1) == []
