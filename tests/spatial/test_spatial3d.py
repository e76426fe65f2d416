"""Volumes on 3-D tile grids: layers, a 3-D network and refusals (one process), and the 8-rank launch of
tests/mpi/spatial3d.py (halo on both planes, every 3-D layer and a 3-D network exact on 2x2x2, 3x2x1, 1x1x4,
4x1x1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.spatial.conv import SpatialConv
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.norm import SpatialBatchNorm
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
    assert isinstance(tiled[0], SpatialConv) and isinstance(tiled[0], nn.Conv3d)
    assert isinstance(tiled[4].bn, SpatialBatchNorm) and isinstance(tiled[4].bn, nn.BatchNorm3d)
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
                                        (nn.ConvTranspose2d(1, 1, 2), TileGrid(depth=2, rows=1, cols=1)),
                                        (nn.InstanceNorm2d(1), TileGrid(depth=2, rows=1, cols=1)),
                                        (nn.AdaptiveMaxPool3d(1), TileGrid(2, 1)),
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


class Mean3d(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3, 4), keepdim=True)    # a global mean in a custom forward: not computed on volumes yet


class Resampled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=2, mode="trilinear")   # functional: not computed on volumes yet


class AlphaDropped(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.alpha_dropout(x, 0.5, True)    # its noise is not a mask one can slice


class ChannelSoftmaxCat(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.softmax(dim=1)], dim=1)   # along channels: exact


@pytest.mark.parametrize("module,op", [(Mean3d(), "mean"), (Resampled(), "interpolate"),
                                       (AlphaDropped(), "alpha_dropout")])
def test_volume_functional_ops_not_made_exact_are_refused(module, op):
    tiled = spatialize(nn.Sequential(nn.Conv3d(1, 1, 1), module), TileGrid(depth=1, rows=1, cols=1), OneRank())
    with pytest.raises(ConfigError) as refused:
        tiled(torch.randn(1, 1, 4, 4, 4))
    message = str(refused.value)
    assert type(module).__name__ in message and op in message, message


def test_volume_channel_ops_run_on_tiles():
    net = nn.Sequential(nn.Conv3d(1, 2, 1), ChannelSoftmaxCat()).double()
    x = torch.randn(1, 1, 4, 5, 6, dtype=torch.float64)
    tiled = spatialize(net, TileGrid(depth=1, rows=1, cols=1), OneRank())
    torch.testing.assert_close(tiled(x), net(x), rtol=1e-12, atol=0)


@pytest.mark.parametrize("layer,knob", [
    (nn.Conv3d(1, 1, 3, padding=1, padding_mode="reflect"), "padding_mode"),
    (nn.ConvTranspose3d(1, 1, 3, padding_mode="zeros", dilation=1), None),
    (nn.AdaptiveAvgPool3d(2), "output_size"),
    (nn.AdaptiveMaxPool3d(1, return_indices=True), "output_size"),
])
def test_volume_layer_arguments_not_exact_are_refused_when_converted(layer, knob):
    grid = TileGrid(depth=1, rows=1, cols=1)
    if knob is None:   # supported: converted
        assert type(spatialize(layer, grid, OneRank())).__name__.startswith("Spatial")
        return
    with pytest.raises(ConfigError, match=knob):
        spatialize(layer, grid, OneRank())


def test_volume_upsampling_mode_of_images_is_refused_naming_the_modes():
    up = spatialize(nn.Upsample(scale_factor=2, mode="bilinear"), TileGrid(depth=1, rows=1, cols=1), OneRank())
    with pytest.raises(ConfigError, match="trilinear"):
        up(torch.randn(1, 1, 4, 4, 4))


def test_volume_transposed_conv_refuses_output_size():
    conv = spatialize(nn.ConvTranspose3d(1, 1, 3, 2), TileGrid(depth=1, rows=1, cols=1), OneRank())
    with pytest.raises(ConfigError, match="output_padding"):
        conv(torch.randn(1, 1, 4, 4, 4), output_size=[9, 9, 9])
