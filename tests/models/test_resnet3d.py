"""The 3-D ResNet trunk (models/resnet3d.py): sizes and layer kinds, depths, its registration as a built-in model."""

import pytest
import torch
from torch import nn

from mpi4dl_nb.models import ModelSpec, build_model, image_multiple
from mpi4dl_nb.models.resnet import BasicBlock
from mpi4dl_nb.models.resnet3d import VolumeHead, VolumeStem, blocks_for_depth, resnet3d


def test_resnet3d_classifies_volumes_with_3d_layers_only():
    torch.manual_seed(0)
    layers = resnet3d(18, 3, width=2, in_channels=2)
    assert [type(layer) for layer in layers] == [VolumeStem] + [BasicBlock] * 8 + [VolumeHead]
    net = nn.Sequential(*layers)
    assert net(torch.randn(2, 2, 16, 32, 16)).shape == (2, 3)
    kinds = {type(m) for m in net.modules()}
    assert {nn.Conv3d, nn.BatchNorm3d, nn.AdaptiveAvgPool3d} <= kinds
    assert not kinds & {nn.Conv2d, nn.BatchNorm2d, nn.AdaptiveAvgPool2d}
    strides = [m.conv1.stride for m in layers if isinstance(m, BasicBlock)]
    assert strides == [(1, 1, 1)] * 2 + [(2, 2, 2), (1, 1, 1)] * 3
    assert layers[-1].fc.in_features == 2 * 2 ** 3


def test_stages_keep_a_shallow_trunk_for_small_volumes():
    layers = resnet3d(10, 2, width=4, stages=2)
    assert len(layers) == 1 + 2 + 1 and layers[-1].fc.in_features == 8
    assert nn.Sequential(*layers)(torch.randn(1, 1, 4, 4, 8)).shape == (1, 2)
    assert blocks_for_depth(34) == (3, 4, 6, 3) and blocks_for_depth(34, 2) == (3, 4)
    with pytest.raises(ValueError, match="10, 18, 34"):
        blocks_for_depth(50)
    with pytest.raises(ValueError, match="1 to 4 stages"):
        resnet3d(18, stages=5)


def test_resnet3d_is_a_built_in_model():
    layers = build_model("resnet3d", num_classes=2, in_channels=1)
    assert len(layers) == 10 and layers[0].conv.out_channels == 8 and isinstance(layers[0].conv, nn.Conv3d)
    assert image_multiple("resnet3d") == 16
    with pytest.raises(ValueError, match="multiple of 16"):
        build_model("resnet3d", image_size=24)
    with pytest.raises(ValueError, match="average only"):
        build_model("resnet3d", pool="max")
    spec = ModelSpec.of("resnet3d", num_layers=34, num_filters=4, num_classes=3, in_channels=1)
    assert (spec.num_layers, spec.resnet_version, spec.norm, spec.image_multiple) == (34, None, None, 16)
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    assert spec.describe() == "resnet3d 34 layers x 4 filters, 3 classes, 1 input channels"
    assert sum(isinstance(m, BasicBlock) for m in spec.build(image_size=16)) == 16
