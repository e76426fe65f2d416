"""halo_checked: the shape-only pre-flight check that every conv/pool halo fits the tiles."""
import pytest
import torch
from torch import nn

from mpi4dl_nb.config import ParallelConfig
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.run.trainer import check_spatial_geometry
from mpi4dl_nb.spatial.fit import halo_checked
from mpi4dl_nb.spatial.geometry import TileGrid


def stack() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 4, 7, padding=3), nn.MaxPool2d(3, 1, 1), nn.Conv2d(4, 4, 3, padding=1))


def test_fitting_tiles_pass_and_the_probe_is_shape_only():
    with halo_checked(stack(), TileGrid(2, 2)) as probe:
        out = probe(torch.empty(1, 3, 32, 32, device="meta"))
    assert out.shape == (1, 4, 32, 32) and out.device.type == "meta"


def test_thin_tiles_are_refused_naming_the_layer_and_hooks_are_removed():
    with pytest.raises(ConfigError, match="net.0"):
        with halo_checked(stack(), TileGrid(1, 8), label=lambda name: f"net.{name}") as probe:
            probe(torch.empty(1, 3, 16, 16, device="meta"))     # 2 px columns, a 7x7 conv reaches 3
    with halo_checked(stack(), TileGrid(1, 8)) as probe:
        pass
    assert all(not m._forward_pre_hooks for m in probe.modules())


def test_training_preflight_names_the_layer_of_the_whole_model():
    layers = [nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 7, padding=3), nn.AdaptiveAvgPool2d(1),
              nn.Flatten(), nn.Linear(4, 2)]
    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=8, slice_method="vertical",
                         balance=(2, 3))
    check_spatial_geometry(layers, cfg, 64)                       # 8 px columns: the 7x7 conv fits
    with pytest.raises(ConfigError, match=r": 1 \(cols\)"):      # 2 px columns: layer 1 reaches 3
        check_spatial_geometry(layers, cfg, 16)
