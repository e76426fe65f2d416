"""Classifier -> fully convolutional network: one patch gives the classifier's probabilities; the measured
field bounds what a cell depends on; dense models and refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.infer.fully_conv import fully_convolutional, measure_field
from mpi4dl_nb.models import build_model


def classifier(name="resnet", layers=8, filters=4, version=1):
    torch.manual_seed(0)
    model = nn.Sequential(*build_model(name, num_layers=layers, num_filters=filters, num_classes=3,
                                       version=version)).double().eval()
    for module in model.modules():   # non-trivial BatchNorm statistics
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return list(model)


@pytest.mark.parametrize("version", [1, 2])
def test_one_patch_gives_the_classifiers_probabilities(version):
    layers = classifier(layers=8 if version == 1 else 11, version=version)
    net = fully_convolutional(layers, 32)
    x = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        expected = torch.softmax(nn.Sequential(*layers)(x), dim=1)
        cells = net(x)
    assert cells.shape == (2, 3, 1, 1) and net.shape.stride == 4 and net.shape.min_side == 32
    assert torch.allclose(cells[:, :, 0, 0], expected, rtol=1e-12, atol=1e-14)


def test_output_stride_and_bigger_inputs():
    net = fully_convolutional(classifier(), 32, output_stride=8)
    assert net.shape.stride == 8 and net.shape.align == 8
    with torch.no_grad():
        out = net(torch.rand(1, 3, 64, 96, dtype=torch.float64))
    assert out.shape == (1, 3, 5, 9)           # (features 16x24 - window 8) / 2 + 1
    assert torch.allclose(out.sum(dim=1), torch.ones(1, 5, 9, dtype=torch.float64))
    with pytest.raises(ConfigError, match="--output-stride: must be a multiple of the trunk's stride 4"):
        fully_convolutional(classifier(), 32, output_stride=6)


def test_cells_do_not_depend_on_pixels_outside_the_measured_field():
    net = fully_convolutional(classifier(), 32)
    rows, cols = measure_field(net)
    assert rows == cols and rows.stride == 4 and 0 < rows.before < 32 and 32 <= rows.after < 80
    x = torch.rand(1, 3, 96, 160, dtype=torch.float64)
    with torch.no_grad():
        base = net(x)[0]
    j = 10                                              # a cell well inside
    left, right = j * 4 - cols.before, j * 4 + cols.after
    for region in (slice(0, left), slice(right, None)):
        y = x.clone()
        y[..., region] = torch.rand_like(y[..., region]) * 7 - 3
        with torch.no_grad():
            moved = net(y)[0]
        assert torch.equal(moved[:, :, j], base[:, :, j]), f"cell {j} depends on columns {region}"
    y = x.clone()
    y[..., left:right] += 0.5
    with torch.no_grad():
        assert not torch.equal(net(y)[0][:, :, j], base[:, :, j])


def test_amoebanet_becomes_fully_convolutional():
    net = fully_convolutional(classifier("amoebanet", 3, 8), 64)
    assert (net.shape.stride, net.shape.align, net.shape.min_side) == (32, 32, 64)


def test_dense_models_get_per_pixel_probabilities_and_pooled_ones_are_refused():
    torch.manual_seed(0)
    dense = [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 4, 3, padding=1)]
    net = fully_convolutional(dense, None)
    assert (net.shape.stride, net.shape.align, net.shape.classes) == (2, 2, 4)
    with torch.no_grad():
        out = net(torch.rand(1, 3, 20, 30))
    assert out.shape == (1, 4, 10, 15) and torch.allclose(out.sum(dim=1), torch.ones(1, 10, 15))
    pooled = [nn.Conv2d(3, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2)]
    with pytest.raises(ConfigError, match="not a ClassifierHead"):
        fully_convolutional(pooled, 32)


@pytest.mark.parametrize("pool", ["max", "attention"])
def test_a_head_pooling_the_whole_canvas_is_refused_not_mapped_as_an_average(pool):
    layers = build_model("resnet", num_layers=8, num_filters=4, num_classes=2, version=1, pool=pool)
    with pytest.raises(ConfigError, match=f"pools the whole canvas by {pool}"):
        fully_convolutional(layers, 32)
