"""The 3-D U-Net (``unet3d``, ``unet`` with ``dims=3``): sizes, layer kinds, the registration, its loss on voxels."""

import pytest
import torch
from torch import nn

from mpi4dl_nb.loss import DenseLoss
from mpi4dl_nb.models import build_model, image_multiple
from mpi4dl_nb.models.unet import Bottleneck, Down, Up, unet
from mpi4dl_nb.models.unet3d import unet3d


@pytest.mark.parametrize("norm, upsampling, norm_kind, up_kind", [
    ("batch", "trilinear", nn.BatchNorm3d, nn.Upsample), ("group", "transposed", nn.GroupNorm, nn.ConvTranspose3d)])
def test_unet3d_outputs_class_volumes_as_large_as_its_input(norm, upsampling, norm_kind, up_kind):
    torch.manual_seed(0)
    layers = unet3d(2, 4, 3, in_channels=2, norm=norm, upsampling=upsampling)
    assert [type(layer) for layer in layers] == [Down] * 2 + [Bottleneck] + [Up] * 2 + [nn.Conv3d]
    x = torch.randn(2, 2, 8, 12, 16)
    assert nn.Sequential(*layers)(x).shape == (2, 3, 8, 12, 16)
    modules = list(nn.Sequential(*layers).modules())
    assert {type(m) for m in modules if isinstance(m, (nn.GroupNorm, nn.BatchNorm3d, nn.BatchNorm2d))} == {norm_kind}
    assert any(isinstance(m, up_kind) for m in modules) and not any(isinstance(m, nn.Conv2d) for m in modules)
    assert all(m.mode == "trilinear" for m in modules if isinstance(m, nn.Upsample))


def test_skips_of_volumes_travel_as_tuples():
    torch.manual_seed(0)
    state = torch.randn(1, 1, 8, 8, 8)
    layers = unet3d(2, 2, 2)
    for layer in layers[:2]:
        state = layer(state)
    assert [tuple(t.shape) for t in state] == [(1, 4, 2, 2, 2), (1, 2, 8, 8, 8), (1, 4, 4, 4, 4)]


def test_unet3d_is_registered_with_small_defaults_and_its_downsampling():
    layers = build_model("unet3d", num_classes=2, in_channels=1)
    assert len(layers) == 2 * 2 + 2 and layers[0].conv.body[0].out_channels == 8   # depth 2, 8 filters
    assert image_multiple("unet3d") == 4 and image_multiple("unet3d", 3) == 8
    assert isinstance(build_model("unet3d", num_layers=1, num_filters=2, upsampling="transposed")[2].up,
                      nn.ConvTranspose3d)
    with pytest.raises(ValueError, match="multiple of 4"):
        build_model("unet3d", image_size=18)


def test_upsampling_of_the_other_dimension_is_refused_naming_the_right_one():
    with pytest.raises(ValueError, match="'trilinear' or 'transposed'"):
        unet3d(upsampling="bilinear")
    with pytest.raises(ValueError, match="'bilinear' or 'transposed'"):
        unet(2, 2, upsampling="trilinear")
    with pytest.raises(ValueError, match="dims=4"):
        unet(2, 2, dims=4)


@pytest.mark.parametrize("kind, weights, ignore", [("ce+dice", (1.0, 2.0, 0.5), 255), ("dice", None, None)])
def test_dense_loss_on_voxels_equals_the_loss_on_the_same_voxels_as_pixels(kind, weights, ignore):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 4, 5, 6, generator=gen, dtype=torch.float64)
    mask = torch.randint(0, 3, (2, 4, 5, 6), generator=gen)
    if ignore is not None:
        mask[torch.rand(mask.shape, generator=gen) < 0.2] = ignore
    loss = DenseLoss(kind, weights, ignore)
    as_pixels = loss(logits.reshape(2, 3, 20, 6), mask.reshape(2, 20, 6))   # every sum runs over the same voxels
    assert float(loss(logits, mask)) == pytest.approx(float(as_pixels), rel=1e-12)
    with pytest.raises(ValueError, match="label volumes"):
        loss(logits, mask[:, 0])
