"""Fused halos on a volume's 2x2x2 grid (spatial/fused.py over three axes, tests/mpi/halo_fused.py): equal to one
process and to unfused with fewer messages, on both data planes (in the shared 8-rank launch); a 1-process check
that the blocks form in 3-D as in 2-D."""

from __future__ import annotations

from torch import nn

from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.fused import FusedSequential
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.mpi import halo_fused
from tests.support.battery import shared_job

PLANES = "mpi,gloo"
VOLUME = shared_job(8, "halo_fused", "2", "2", "2", PLANES, timeout=300)   # shares the 8-rank launch


def test_fused_volume_halos_equal_unfused_and_serial_on_both_planes(shared_launch):
    shared_launch(VOLUME).require_clean(halo_fused.volume_check_names(PLANES))


def test_volume_blocks_group_windowed_layers_across_batch_norm():
    class OneRank:
        rank, world_size = 0, 1

    seq = nn.Sequential(nn.Conv3d(1, 1, 3), nn.BatchNorm3d(1), nn.ReLU(), nn.MaxPool3d(2), nn.Conv3d(1, 1, 1),
                        nn.AdaptiveAvgPool3d(1), nn.Conv3d(1, 1, 3), nn.MaxPool3d(2, ceil_mode=True))
    net = spatialize(seq, TileGrid(depth=1, rows=1, cols=1), OneRank(), halo_d2=True, fused_layers=3)
    assert isinstance(net, FusedSequential)
    assert [(block.start, block.stop) for block in net.fused_blocks.values()] == [(0, 5)]
