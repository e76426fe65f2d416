"""The U-Net layer list: sizes, the tuple convention between layers, any cut into stages, its ModelSpec."""

import pytest
import torch
from torch import nn

from mpi4dl_nb.models import ModelSpec, build_model
from mpi4dl_nb.models.unet import Bottleneck, Down, Up, unet


@pytest.mark.parametrize("norm, upsampling", [("batch", "bilinear"), ("group", "transposed")])
def test_unet_outputs_class_maps_as_large_as_its_input(norm, upsampling):
    torch.manual_seed(0)
    layers = unet(3, 4, 5, in_channels=2, norm=norm, upsampling=upsampling)
    assert len(layers) == 2 * 3 + 2
    assert [type(layer) for layer in layers] == [Down] * 3 + [Bottleneck] + [Up] * 3 + [nn.Conv2d]
    x = torch.randn(2, 2, 24, 40)
    assert nn.Sequential(*layers)(x).shape == (2, 5, 24, 40)
    groups = [m for m in nn.Sequential(*layers).modules() if isinstance(m, (nn.GroupNorm, nn.BatchNorm2d))]
    assert all(isinstance(m, nn.GroupNorm if norm == "group" else nn.BatchNorm2d) for m in groups)


def test_skips_travel_as_tuples_so_any_cut_runs():
    torch.manual_seed(0)
    layers = unet(2, 2, 3)
    state = torch.randn(1, 3, 16, 16)
    shapes = []
    for layer in layers:
        state = layer(state)
        shapes.append([tuple(t.shape) for t in state] if isinstance(state, tuple) else tuple(state.shape))
    assert shapes[0] == [(1, 2, 8, 8), (1, 2, 16, 16)]                  # (pooled, skip)
    assert shapes[1] == [(1, 4, 4, 4), (1, 2, 16, 16), (1, 4, 8, 8)]    # skips pushed in order
    assert shapes[3] == [(1, 4, 8, 8), (1, 2, 16, 16)] and shapes[4] == (1, 2, 16, 16)
    with pytest.raises(ValueError, match="needs a skip connection"):
        layers[4](torch.randn(1, 4, 8, 8))


def test_unet_spec_round_trip_and_image_multiple():
    spec = ModelSpec.of("unet", num_layers=3, num_filters=4, num_classes=3, norm="group")
    assert spec.upsampling == "bilinear" and spec.image_multiple == 8 and spec.family.dense
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    assert "unet depth 3 width 4 (group norm, bilinear), 3 classes" == spec.describe()
    assert ModelSpec.of("resnet").norm is None and not ModelSpec.of("resnet").family.dense
    assert len(spec.build(24)) == 8
    with pytest.raises(ValueError, match="multiple of 8"):
        build_model("unet", num_layers=3, image_size=20)
    with pytest.raises(ValueError, match="norm"):
        unet(2, 2, norm="layer")
