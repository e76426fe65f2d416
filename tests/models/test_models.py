"""Models: ResNet v1/v2 and AmoebaNet-D build for several sizes as layer lists, give logits at any image size,
and train exactly like one process under SP+LP and LP+PP+GEMS (tests/mpi/models_exact.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mpi4dl_nb.models import ClassifierHead, amoebanet, build_model, resnet_v1, resnet_v2
from mpi4dl_nb.models.amoebanet import AmoebaCell, cell_plans
from mpi4dl_nb.models.resnet import BasicBlock, PreActBottleneck, blocks_per_stage, version_for_depth
from tests.mpi import models_exact
from tests.support.battery import shared_job

SIZES = {
    "resnet_v1": [8, 14, 20],
    "resnet_v2": [11, 20, 29],
    "amoebanet": [3, 6, 9],
}


def build(family: str, size: int, num_classes: int = 10) -> list[nn.Module]:
    if family == "resnet_v1":
        return resnet_v1(size, num_classes, width=4)
    if family == "resnet_v2":
        return resnet_v2(size, num_classes, width=4)
    return amoebanet(size, 8, num_classes)


def conv_count(layers: list[nn.Module]) -> int:
    """Weighted layers on the main path, as counted for a ResNet's depth."""
    return sum(1 for layer in layers for m in layer.modules()
               if isinstance(m, nn.Conv2d) and m.kernel_size != (1, 1) or isinstance(m, nn.Linear))


@pytest.mark.parametrize("family", sorted(SIZES))
def test_builds_three_sizes_as_layer_lists(family):
    lengths = []
    for size in SIZES[family]:
        torch.manual_seed(0)
        layers = build(family, size, num_classes=7)
        assert isinstance(layers, list) and all(isinstance(item, nn.Module) for item in layers)
        assert isinstance(layers[-1], ClassifierHead)
        model = nn.Sequential(*layers)
        out = model(torch.randn(2, 3, 32, 32))
        assert out.shape == (2, 7)
        # logits, not probabilities: rows do not sum to one and values can be negative
        assert not torch.allclose(out.softmax(1).sum(1), out.sum(1))
        lengths.append(len(layers))
    assert lengths == sorted(lengths) and len(set(lengths)) == 3


def test_resnet_depths():
    assert len(resnet_v1(20)) == 2 + 9                     # stem, 3x3 basic blocks, head
    assert len(resnet_v2(110)) == 2 + 36                   # ResNet-110 v2: 3 stages of 12
    blocks = [item for item in resnet_v2(110) if isinstance(item, PreActBottleneck)]
    assert len(blocks) == 36 and 9 * 12 + 2 == 110
    # v1 depth counts every 3x3 conv plus the classifier: 6n + 2 (stem + 2 per block + fc)
    assert conv_count(resnet_v1(32)) == 32
    assert [b.conv1.stride for b in resnet_v1(20) if isinstance(b, BasicBlock)].count((2, 2)) == 2
    assert blocks_per_stage(110, 2) == 12 and blocks_per_stage(56, 1) == 9
    # without --resnet-version: v2, unless the depth is one only v1 has (the issue's `--num-layers 8`)
    assert [version_for_depth(d, None) for d in (8, 11, 14, 20, 26, 110, None)] == [1, 2, 1, 2, 1, 2, 2]
    assert version_for_depth(8, 2) == 2                  # asked for: kept (and refused by the builder)
    assert version_for_depth(50, None) == 2               # ImageNet depth: refused, pointing to torchvision
    with pytest.raises(ValueError, match=r"9n\+2.*101, 110"):
        resnet_v2(108)
    with pytest.raises(ValueError, match="version must be 1 or 2"):
        build_model("resnet", num_layers=20, version=3)


def test_resnet_widths():
    v2 = resnet_v2(11, width=16)
    channels = [b.conv3.out_channels for b in v2 if isinstance(b, PreActBottleneck)]
    assert channels == [64, 128, 256]         # outputs 4w, 8w, 16w
    v1 = resnet_v1(8, width=16)
    assert [b.conv2.out_channels for b in v1 if isinstance(b, BasicBlock)] == [16, 32, 64]


def test_amoebanet_cells_and_channels():
    plans = cell_plans(6, 10)
    kinds = ["R" if p.reduction else "N" for p in plans]
    assert "".join(kinds) == "RR" + "NN" + "R" + "NN" + "R" + "NN"
    assert [p.channels for p in plans] == [10, 20, 40, 40, 80, 80, 80, 160, 160, 160]
    layers = amoebanet(6, 40, 5)
    assert len(layers) == 1 + len(plans) + 1
    cells = [item for item in layers if isinstance(item, AmoebaCell)]
    assert cells[-1].next_h0 is None and all(c.next_h0 is not None for c in cells[:-1])
    # normal cells concatenate 4 states, reduction cells 3
    assert cells[2].plan.out_channels == 4 * 40 and cells[0].plan.out_channels == 3 * 10
    with pytest.raises(ValueError, match="multiple of 3.*use e.g. 6"):
        amoebanet(5, 16)
    with pytest.raises(ValueError, match="num_filters >= 4"):
        amoebanet(3, 2)


def test_amoebanet_downsamples_32x_and_checks_image_size():
    layers = amoebanet(3, 8, 3)
    x = torch.randn(1, 3, 64, 64)
    for layer in layers[:-1]:
        x = layer(x)
    assert x.shape[-2:] == (2, 2)
    with pytest.raises(ValueError, match="multiple of 32; use e.g. 96"):
        build_model("amoebanet", num_layers=3, num_filters=8, image_size=100)
    with pytest.raises(ValueError, match="multiple of 4"):
        build_model("resnet", num_layers=8, version=1, image_size=30)


@pytest.mark.parametrize("family", sorted(SIZES))
def test_head_any_image_size(family):
    layers = build(family, SIZES[family][0], 4)
    model = nn.Sequential(*layers).eval()
    for side in (32, 64, 96):
        assert model(torch.randn(1, 3, side, side)).shape == (1, 4)


def test_build_model_defaults_match_mpi4dl():
    amoeba = build_model("amoebanet", num_filters=8)
    assert sum(isinstance(item, AmoebaCell) for item in amoeba) == 18 + 4     # 18 normal + 4 reductions
    res = build_model("resnet", num_filters=4)
    assert sum(isinstance(item, PreActBottleneck) for item in res) == 36      # ResNet-110 v2
    with pytest.raises(ValueError, match="choose one of resnet, amoebanet"):
        build_model("vgg")


EXACT = shared_job(5, "models_exact", timeout=600)


def test_models_train_exactly_in_parallel(shared_launch):
    """Every family x 3 sizes: SP+LP (5 ranks) and LP+PP+GEMS equal serial in float64."""
    names = models_exact.check_names()
    assert len(names) == 12 + 3     # 9 SP+LP and 3 LP+PP+GEMS trainings, 3 spatial stages with D2 halos
    shared_launch(EXACT).require_clean(names)
