"""CIFAR-style ResNet v1 (basic blocks, depth 6n+2) and v2 (pre-activation bottlenecks, depth 9n+2) as layer lists."""
from __future__ import annotations

import torch
from torch import nn

from .head import ClassifierHead
from .unet import LAYERS, Layers

STAGES = 3  # three stages of n blocks, the second and third start with stride 2
IMAGENET_DEPTHS = (18, 34, 50, 101, 152)   # torchvision's ResNets, which a depth here may be mistaken for


def conv3x3(in_channels: int, out_channels: int, stride: int = 1,
            dims: Layers = LAYERS[2]) -> nn.Conv2d | nn.Conv3d:
    """3x3 (3x3x3 with ``dims`` of volumes) convolution, 'same' padding, no bias (a BatchNorm follows or precedes)."""
    return dims.conv(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


def conv1x1(in_channels: int, out_channels: int, stride: int = 1,
            dims: Layers = LAYERS[2]) -> nn.Conv2d | nn.Conv3d:
    """1x1 (1x1x1) convolution without bias."""
    return dims.conv(in_channels, out_channels, 1, stride=stride, bias=False)


class ResNetStem(nn.Module):
    """First layer: 3x3 conv -> BN -> ReLU."""

    def __init__(self, in_channels: int, width: int) -> None:
        super().__init__()
        self.conv = conv3x3(in_channels, width)
        self.bn = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class BasicBlock(nn.Module):
    """ResNet v1 block: conv-BN-ReLU-conv-BN plus shortcut (1x1 conv + BN when the shape changes), ReLU.

    ``dims``: the layer kinds, images' (default) or volumes' (``LAYERS[3]``: Conv3d, BatchNorm3d; models/resnet3d.py).
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1, dims: Layers = LAYERS[2]) -> None:
        super().__init__()
        self.conv1 = conv3x3(in_channels, out_channels, stride, dims)
        self.bn1 = dims.batch_norm(out_channels)
        self.relu1 = nn.ReLU()
        self.conv2 = conv3x3(out_channels, out_channels, dims=dims)
        self.bn2 = dims.batch_norm(out_channels)
        self.relu2 = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(conv1x1(in_channels, out_channels, stride, dims),
                                          dims.batch_norm(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        return self.relu2(y + self.shortcut(x))


class PreActBottleneck(nn.Module):
    """ResNet v2 block: (BN-ReLU) 1x1 -> BN-ReLU 3x3 (stride) -> BN-ReLU 1x1 (x4 width), plus shortcut.

    ``preactivate=False`` on the very first block, whose input already went through the stem's BN-ReLU.
    """

    def __init__(self, in_channels: int, width: int, out_channels: int, stride: int = 1,
                 preactivate: bool = True) -> None:
        super().__init__()
        self.pre = (nn.Sequential(nn.BatchNorm2d(in_channels), nn.ReLU())
                    if preactivate else nn.Identity())
        self.conv1 = conv1x1(in_channels, width)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu2 = nn.ReLU()
        self.conv2 = conv3x3(width, width, stride)
        self.bn3 = nn.BatchNorm2d(width)
        self.relu3 = nn.ReLU()
        self.conv3 = conv1x1(width, out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = conv1x1(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(self.pre(x))
        y = self.conv2(self.relu2(self.bn2(y)))
        y = self.conv3(self.relu3(self.bn3(y)))
        return y + self.shortcut(x)


def version_for_depth(depth: int | None, version: int | None) -> int:
    """The ResNet version to build: the one asked for, else v2 unless ``depth`` is a v1 depth only (8, 14, 26...);
    never v1 for an ImageNet depth (50, 152): those are refused with the way to torchvision's model."""
    if version is not None:
        return version
    v1_only = (depth - 2) % 6 == 0 and depth >= 8 and ((depth - 2) % 9 or depth < 11) if depth is not None else False
    if v1_only and depth not in IMAGENET_DEPTHS:
        return 1
    return 2


def blocks_per_stage(depth: int, version: int) -> int:
    """n for a CIFAR ResNet of ``depth`` (v1: 6n+2, v2: 9n+2); ValueError naming valid depths."""
    per_block = {1: 6, 2: 9}.get(version)
    if per_block is None:
        raise ValueError(f"ResNet version must be 1 or 2, got {version!r}")
    n, rest = divmod(depth - 2, per_block)
    if depth < per_block + 2 or rest:
        near = max(1, round((depth - 2) / per_block))
        valid = sorted({per_block * max(1, near + d) + 2 for d in (-1, 0, 1)})
        imagenet = (f"; for the ImageNet ResNet-{depth} use --model torchvision:resnet{depth} (this is MPI4DL's "
                    f"CIFAR-style ResNet: 3 stages, stride 4)") if depth in IMAGENET_DEPTHS else ""
        raise ValueError(f"depth {depth} is not a ResNet v{version} depth ({per_block}n+2); "
                         f"use e.g. {', '.join(map(str, valid))}{imagenet}")
    return n


def resnet_v1(depth: int = 20, num_classes: int = 10, *, width: int = 16,
              in_channels: int = 3) -> list[nn.Module]:
    """ResNet v1 (He et al. 2015, CIFAR form): stem, 3n basic blocks (widths w, 2w, 4w), head."""
    n = blocks_per_stage(depth, 1)
    layers: list[nn.Module] = [ResNetStem(in_channels, width)]
    channels = width
    for stage in range(STAGES):
        out_channels = width * 2 ** stage
        for block in range(n):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append(BasicBlock(channels, out_channels, stride))
            channels = out_channels
    layers.append(ClassifierHead(channels, num_classes))
    return layers


def resnet_v2(depth: int = 110, num_classes: int = 10, *, width: int = 16,
              in_channels: int = 3) -> list[nn.Module]:
    """ResNet v2 (He et al. 2016, CIFAR form): stem, 3n pre-activation bottlenecks, BN-ReLU head.

    Bottleneck widths per stage are w, 4w, 8w with outputs 4w, 8w, 16w (the Keras CIFAR layout
    MPI4DL's ResNet benchmark follows); ResNet-110 v2 is ``depth=110`` (n=12).
    """
    n = blocks_per_stage(depth, 2)
    layers: list[nn.Module] = [ResNetStem(in_channels, width)]
    channels = width
    for stage in range(STAGES):
        bottleneck = width if stage == 0 else channels
        out_channels = 4 * width if stage == 0 else 2 * channels
        for block in range(n):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append(PreActBottleneck(channels, bottleneck, out_channels, stride,
                                           preactivate=not (stage == 0 and block == 0)))
            channels = out_channels
    layers.append(ClassifierHead(channels, num_classes, norm=True, relu=True))
    return layers


def resnet(depth: int = 110, num_classes: int = 10, *, version: int = 2, width: int = 16,
           in_channels: int = 3) -> list[nn.Module]:
    """ResNet of either version as a list of splittable layers (``nn.Sequential(*layers)`` is serial)."""
    if version == 1:
        return resnet_v1(depth, num_classes, width=width, in_channels=in_channels)
    if version == 2:
        return resnet_v2(depth, num_classes, width=width, in_channels=in_channels)
    raise ValueError(f"ResNet version must be 1 or 2, got {version!r}")
