"""Small float64 models, one per spatial layer type, plus a ResNet-style stack (shared by MPI tests)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class ResidualBlock(nn.Module):
    """BasicBlock: conv-bn-relu-conv-bn, plus identity or a 1x1 stride-s downsample branch."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ElementwiseMix(nn.Module):
    """Element-wise ops in a custom forward: products, residual add, sigmoid gate."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.gate = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.conv(x)) * torch.sigmoid(self.gate(x))
        return x + 0.5 * y - x * y


def resnet_stack(c: int = 3, classes: int | None = None) -> nn.Module:
    """Stem, then stages at strides 1, 2, 2 with BatchNorm and downsample branches."""
    layers: list[nn.Module] = [nn.Conv2d(c, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                               ResidualBlock(8, 8), ResidualBlock(8, 12, 2),
                               ResidualBlock(12, 12), ResidualBlock(12, 16, 2)]
    if classes is not None:
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, classes)]
    return nn.Sequential(*layers)


def layer_models(c: int = 3) -> dict[str, Callable[[], nn.Module]]:
    """Name -> builder of a model exercising one spatial layer type."""
    return {
        "conv3x3": lambda: nn.Conv2d(c, 4, 3, padding=1),
        "conv_valid": lambda: nn.Conv2d(c, 4, 3),
        "conv1x7_7x1": lambda: nn.Sequential(nn.Conv2d(c, 4, (1, 7), padding=(0, 3)),
                                             nn.Conv2d(4, 4, (7, 1), padding=(3, 0))),
        "conv5x5_s2": lambda: nn.Conv2d(c, 4, 5, stride=2, padding=2),
        "conv3x3_s2": lambda: nn.Conv2d(c, 4, 3, stride=2, padding=1),
        "conv1x1_s2": lambda: nn.Conv2d(c, 4, 1, stride=2),
        "conv_dilated": lambda: nn.Conv2d(c, 4, 3, padding=2, dilation=2),
        "conv_groups": lambda: nn.Sequential(nn.Conv2d(c, 4, 3, padding=1),
                                             nn.Conv2d(4, 6, 3, padding=1, groups=2)),
        "conv_same_even": lambda: nn.Conv2d(c, 4, 4, padding="same", bias=False),
        "conv_s3_k4": lambda: nn.Conv2d(c, 4, 4, stride=3, padding=1),
        "maxpool3_s2_p1": lambda: nn.MaxPool2d(3, 2, 1),
        "maxpool2": lambda: nn.MaxPool2d(2),
        "maxpool3_s1_dil2": lambda: nn.MaxPool2d(3, 1, 1, dilation=2),
        "avgpool3_s2_incl": lambda: nn.AvgPool2d(3, 2, 1, count_include_pad=True),
        "avgpool3_s2_excl": lambda: nn.AvgPool2d(3, 2, 1, count_include_pad=False),
        "avgpool_k3_s1_excl": lambda: nn.AvgPool2d(3, 1, 1, count_include_pad=False),
        "avgpool2": lambda: nn.AvgPool2d(2),
        "avgpool_divisor": lambda: nn.AvgPool2d(3, 2, 1, divisor_override=5),
        "batchnorm": lambda: nn.Sequential(nn.Conv2d(c, 4, 3, padding=1, bias=False),
                                           nn.BatchNorm2d(4)),
        "batchnorm_cumulative": lambda: nn.BatchNorm2d(c, momentum=None),
        "batchnorm_no_affine": lambda: nn.BatchNorm2d(c, affine=False),
        "global_avgpool": lambda: nn.Sequential(nn.Conv2d(c, 4, 3, padding=1),
                                                nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                                nn.Linear(4, 3)),
        "elementwise_residual": lambda: nn.Sequential(nn.Conv2d(c, 4, 3, padding=1),
                                                      ElementwiseMix(4), nn.LeakyReLU(0.1),
                                                      nn.GELU()),
        "resnet_stack": lambda: resnet_stack(c),
        "resnet_classifier": lambda: resnet_stack(c, classes=5),
    }
