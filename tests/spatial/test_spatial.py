"""Spatial parallelism equals one process: every layer type and a ResNet stack, on many grids."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.mpi.spatial_exactness import check_names
from tests.support.battery import shared_job
from tests.support.spatial_models import layer_models

# 1x4 and 4x1 run end to end in tests/pipeline/test_engine_exact.py (SP 4 vertical/horizontal) and
# in the fused-halo and correctness grids; here the 1-D case is 1x2/2x1 and 3x3 holds middle tiles.
GRIDS = [(1, 2), (2, 1), (2, 2), (3, 3), (2, 3)]
JOBS = {(rows, cols): shared_job(rows * cols, "spatial_exactness", rows, cols, timeout=400) for rows, cols in GRIDS}
TORCH_PLANE_MODELS = ["resnet_classifier", "avgpool3_s2_excl"]
TORCH_PLANE = shared_job(4, "spatial_exactness", 2, 2, "gloo", ",".join(TORCH_PLANE_MODELS), plane="gloo")


@pytest.mark.parametrize("rows,cols", GRIDS, ids=[f"{r}x{c}" for r, c in GRIDS])
def test_spatialize_equals_serial(shared_launch, rows, cols):
    names = check_names(rows, cols)
    assert len(layer_models()) * 3 == 75 and len(names) >= 75   # 25 layer models x 3 image sizes
    shared_launch(JOBS[(rows, cols)]).require_clean(names)


def test_spatialize_equals_serial_on_the_torch_plane(shared_launch):
    names = check_names(2, 2, TORCH_PLANE_MODELS)
    assert len(names) == 6 + 1    # 2 models x 3 sizes, 1 refusal
    shared_launch(TORCH_PLANE).require_clean(names)


# ---------------------------------------------------------------- in-process (one rank)
@pytest.fixture(scope="module")
def ctx():
    from mpi4dl_nb.comm.context import Context

    return Context(trace=False)


def _model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(4, 4, 1)))


def test_same_parameters_same_state_dict_original_untouched(ctx):
    from mpi4dl_nb.spatial.conv import SpatialConv
    from mpi4dl_nb.spatial.convert import spatialize, tile_partial_parameters
    from mpi4dl_nb.spatial.geometry import TileGrid

    model = _model()
    net = spatialize(model, TileGrid(1, 1), ctx)
    assert isinstance(net[0], SpatialConv) and isinstance(net[0], nn.Conv2d)
    assert type(model[0]) is nn.Conv2d and type(model[3][1]) is nn.Conv2d   # original unchanged
    assert not model._forward_pre_hooks and net._forward_pre_hooks
    assert list(net.state_dict()) == list(model.state_dict())
    for (name, p), (_, q) in zip(net.named_parameters(), model.named_parameters()):
        assert p is q, name
    assert net[1].running_mean is model[1].running_mean
    assert len(tile_partial_parameters(net)) == 6
    net(torch.randn(2, 3, 8, 8))
    assert int(model[1].num_batches_tracked) == 1       # buffers shared with the original


def test_unsupported_layers_are_named(ctx):
    from mpi4dl_nb.config import ConfigError
    from mpi4dl_nb.spatial.convert import spatialize
    from mpi4dl_nb.spatial.geometry import TileGrid

    grid = TileGrid(1, 1)
    bad = nn.Sequential(nn.Conv2d(3, 3, 3), nn.Sequential(nn.PixelShuffle(2)))
    with pytest.raises(ConfigError, match=r"'1\.0' \(PixelShuffle\)"):
        spatialize(bad, grid, ctx)
    with pytest.raises(ConfigError, match=r"'0' \(AdaptiveMaxPool2d, output_size=2"):
        spatialize(nn.Sequential(nn.AdaptiveMaxPool2d(2)), grid, ctx)
    with pytest.raises(ConfigError, match=r"'1' \(LayerNorm, normalized_shape=\[3, 8, 8\]\) normalises over the"):
        spatialize(nn.Sequential(nn.Conv2d(3, 3, 3), nn.LayerNorm([3, 8, 8])), grid, ctx)
    with pytest.raises(ConfigError, match="return_indices"):
        spatialize(nn.MaxPool2d(2, return_indices=True), grid, ctx)
    with pytest.raises(ConfigError, match="padding_mode='zeros'"):
        spatialize(nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect"), grid, ctx)
    with pytest.raises(ConfigError, match="output_size 1"):
        spatialize(nn.AdaptiveAvgPool2d(2), grid, ctx)

    class Scale(nn.Module):
        def forward(self, x):
            return 2 * x

    net = spatialize(nn.Sequential(nn.Conv2d(3, 3, 3), Scale()), grid, ctx, elementwise=(Scale,))
    assert net(torch.randn(1, 3, 5, 5)).shape == (1, 3, 3, 3)


def test_wrong_world_size_is_explained(ctx):
    from mpi4dl_nb.spatial.convert import spatialize
    from mpi4dl_nb.spatial.geometry import TileGrid

    with pytest.raises(ValueError, match="4 tiles but the world has 1"):
        spatialize(_model(), TileGrid(2, 2), ctx)
