"""Small layer-list models for engine tests: a ResNet and an AmoebaNet-style cell stack.

``small_resnet`` uses the package's ResNet (single-tensor activations). ``cell_stack`` is an
AmoebaNet-style stack whose cells pass the pair ``(previous, current)`` — a tuple across
stage boundaries, like the skip inputs of AmoebaNet cells — with BatchNorm everywhere.
Both are spatializable (convs, BatchNorm, pools, element-wise ops, adds).
"""

from __future__ import annotations

import torch
from torch import nn

from mpi4dl_nb.models import resnet


def small_resnet(seed: int = 0, width: int = 4, num_classes: int = 5) -> list[nn.Module]:
    """ResNet v1 depth 8: stem, three basic blocks (two stride 2), classifier: 5 layers."""
    torch.manual_seed(seed)
    return resnet(8, num_classes, version=1, width=width)


def _relu_conv_bn(channels: int, kernel: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.ReLU(), nn.Conv2d(channels, channels, kernel, stride, kernel // 2,
                                              bias=False), nn.BatchNorm2d(channels))


class CellStem(nn.Module):
    """conv-bn; returns ``(h, h)`` so the first cell has both of its inputs."""

    def __init__(self, in_channels: int, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, channels, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.bn(self.conv(x))
        return h, h


class Cell(nn.Module):
    """Two-input cell: ``out = conv3(cur) + pool(prev) + conv1(cur)``; returns ``(cur, out)``.

    A reduction cell (stride 2) also halves ``cur`` before handing it on as ``previous``.
    """

    def __init__(self, channels: int, reduction: bool = False) -> None:
        super().__init__()
        stride = 2 if reduction else 1
        self.branch_conv = _relu_conv_bn(channels, 3, stride)
        self.branch_pool = (nn.MaxPool2d(3, stride, 1) if reduction else nn.AvgPool2d(3, 1, 1))
        self.branch_1x1 = _relu_conv_bn(channels, 1, stride)
        self.carry = _relu_conv_bn(channels, 1, 2) if reduction else nn.Identity()

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        prev, cur = pair
        out = self.branch_conv(cur) + self.branch_pool(prev) + self.branch_1x1(cur)
        return self.carry(cur), out


class CellHead(nn.Module):
    """Global average pool of the current state and a linear classifier."""

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(pair[1]), 1))


def cell_stack(seed: int = 0, channels: int = 4, num_classes: int = 5,
               in_channels: int = 3) -> list[nn.Module]:
    """Stem, normal cell, reduction cell, normal cell, reduction cell, head: 6 layers."""
    torch.manual_seed(seed)
    return [CellStem(in_channels, channels), Cell(channels), Cell(channels, reduction=True),
            Cell(channels), Cell(channels, reduction=True), CellHead(channels, num_classes)]


def deep_cell_stack(seed: int = 0, channels: int = 4, num_classes: int = 5) -> list[nn.Module]:
    """Stem, six cells (reductions at the 3rd and 6th), head: 8 layers (8 stages of an interleaved pipeline)."""
    torch.manual_seed(seed)
    cells = [Cell(channels, reduction=i in (2, 5)) for i in range(6)]
    return [CellStem(3, channels), *cells, CellHead(channels, num_classes)]


def _dense_models() -> dict:
    from tests.support import dense_models

    return {"se_resnet": dense_models.se_resnet_layers, "unet": dense_models.unet_layers,
            "norms": dense_models.norm_layers, "reused_bn": dense_models.reused_bn_layers}


MODELS = {"resnet": small_resnet, "cells": cell_stack, "cells8": deep_cell_stack, **_dense_models()}
SEGMENTATION = {"unet": 3}    # per-pixel models: name -> classes (labels are (B, H, W))


def build(name: str, seed: int = 0) -> list[nn.Module]:
    """A fresh float64 copy of test model ``name`` (same seed -> same weights)."""
    return [layer.double() for layer in MODELS[name](seed)]


def labels(name: str, batch: int, image: int, generator: torch.Generator) -> torch.Tensor:
    """Random targets for model ``name``: classes (B,) or per-pixel classes (B, H, W)."""
    if name in SEGMENTATION:
        return torch.randint(0, SEGMENTATION[name], (batch, image, image), generator=generator)
    return torch.randint(0, 5, (batch,), generator=generator)
