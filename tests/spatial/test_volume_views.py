"""Views of a volume's tile under the op guard: those keeping the voxel dims last run (activation recomputation
replays through ``view_as``), those mixing them are refused naming module and op (one process, one tile)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.spatial.test_spatial3d import OneRank


class Viewed(nn.Module):
    def __init__(self, view: str) -> None:
        super().__init__()
        self.view = view

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        n, c, d, h, w = y.shape
        if self.view == "view_as":
            return y.view_as(y) * 2
        if self.view == "reshape":   # channels split in two: the voxel dims stay last
            return y.reshape(n, 2, c // 2, d, h, w).sum(1)
        if self.view == "view":      # channels and depth merged
            return y.view(n, c * d, h, w)
        return y.flatten(2)          # every voxel in one dim


def tiled(view: str) -> nn.Module:
    torch.manual_seed(0)
    return spatialize(nn.Sequential(nn.Conv3d(1, 4, 1), Viewed(view)), TileGrid(depth=1, rows=1, cols=1), OneRank())


@pytest.mark.parametrize("view", ["view_as", "reshape"])
def test_views_keeping_the_voxel_dims_last_run_and_equal_the_serial_model(view):
    x = torch.randn(2, 1, 3, 4, 5, dtype=torch.float64)
    net = tiled(view).double()
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Conv3d(1, 4, 1), Viewed(view)).double()
    torch.testing.assert_close(net(x), serial(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("view, op", [("view", "view"), ("flatten", "flatten")])
def test_views_mixing_the_voxel_dims_are_refused_naming_module_and_op(view, op):
    with pytest.raises(ConfigError) as refused:
        tiled(view)(torch.randn(2, 1, 3, 4, 5))
    message = str(refused.value)
    assert "Viewed" in message and op in message, message
