"""Volumes on 3-D tile grids: layers, a 3-D network and refusals (one process), and the 8-rank launch of
tests/mpi/spatial3d.py (halo on both planes, every 3-D layer and a 3-D network exact on 2x2x2, 3x2x1, 1x1x4,
4x1x1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.mpi import spatial3d
from tests.support.battery import shared_job

JOB = shared_job(spatial3d.WORLD, "spatial3d", timeout=600)


class OneRank:
    """A world of one process (no MPI): collectives are the identity."""

    rank, world_size = 0, 1

    def all_reduce(self, t: torch.Tensor, group: object = None) -> torch.Tensor:
        return t


def test_volumes_exact_on_every_grid(shared_launch):
    shared_launch(JOB).require_clean(spatial3d.check_names())


def test_one_tile_volume_network_equals_the_serial_one():
    net = spatial3d.conv_stack()
    x = torch.randn(2, 2, *spatial3d.STACK_SIZES, dtype=torch.float64)
    tiled = spatialize(net, TileGrid(depth=1, rows=1, cols=1), OneRank())
    assert type(tiled[0]).__name__ == "SpatialConv3d" and type(tiled[4].bn).__name__ == "SpatialBatchNorm3d"
    ref = net(x)
    torch.testing.assert_close(tiled(x), ref, rtol=1e-10, atol=1e-12)


class DepthMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).mean(dim=2)    # a mean over the split depth axis: not exact on tiles


class ShiftedAdd(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.ones(x.shape[-3:], dtype=x.dtype)    # a replicated volume-sized operand


@pytest.mark.parametrize("module,op", [(DepthMean(), "mean"), (ShiftedAdd(), "add")])
def test_volume_op_that_cannot_be_exact_is_refused_naming_module_and_op(module, op):
    tiled = spatialize(nn.Sequential(nn.Conv3d(1, 1, 1), module), TileGrid(depth=1, rows=1, cols=1), OneRank())
    with pytest.raises(ConfigError) as refused:
        tiled(torch.randn(1, 1, 4, 4, 4))
    message = str(refused.value)
    assert f"{type(module).__name__}" in message and op in message, message


@pytest.mark.parametrize("layer,grid", [(nn.Conv2d(1, 1, 3), TileGrid(depth=2, rows=1, cols=1)),
                                        (nn.ConvTranspose3d(1, 1, 2), TileGrid(depth=2, rows=1, cols=1)),
                                        (nn.Conv3d(1, 1, 3), TileGrid(2, 1))])
def test_layers_of_the_other_dimension_are_refused_before_work(layer, grid):
    class World:
        rank, world_size = 0, grid.num_tiles

    with pytest.raises(ConfigError, match=type(layer).__name__):
        spatialize(nn.Sequential(nn.ReLU(), layer), grid, World())


def test_volume_grid_refuses_image_knobs():
    with pytest.raises(ConfigError, match="image_size"):
        spatialize(nn.Conv3d(1, 1, 3), TileGrid(depth=1, rows=1, cols=1), OneRank(), image_size=(8, 8))


def test_max_pool_ties_and_padding_follow_torch_on_one_tile():
    tiled = spatialize(nn.MaxPool3d(3, 2, 1, ceil_mode=True), TileGrid(depth=1, rows=1, cols=1), OneRank())
    x = torch.zeros(1, 1, 5, 6, 7)
    assert torch.equal(tiled(x), F.max_pool3d(x, 3, 2, 1, ceil_mode=True))
