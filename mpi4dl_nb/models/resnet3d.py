"""A 3-D ResNet trunk for volumes ``(N, C, D, H, W)``: a strided stem, ResNet-18/34 basic blocks, a global-pool head.

The layers (each splittable into stages): the stem (3x3x3 convolution of stride 2, BatchNorm3d, ReLU), the
basic blocks of ``models/resnet.py`` made of Conv3d and BatchNorm3d (stage ``s`` has ``width * 2**s`` channels;
every stage after the first starts with stride 2) and ``VolumeHead`` (global average pool, linear). ResNet-18
has 2 blocks in each of its 4 stages, ResNet-34 3, 4, 6, 3 (He et al. 2016; Hara et al. 2018 for 3-D);
``stages`` keeps the first few stages only, for small volumes. Every operation is one ``spatialize`` makes exact
on a volume's tiles. Volume sides must be multiples of ``resnet3d_multiple(stages)``.
"""
from __future__ import annotations

import torch
from torch import nn

from .resnet import BasicBlock
from .unet import LAYERS

VOLUME = LAYERS[3]
BLOCKS = {10: (1, 1, 1, 1), 18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}   # depth -> basic blocks per stage
DEPTH = 18
WIDTH = 8        # channels of the first stage (activations grow with the cube of the side: start small)
IN_CHANNELS = 1  # microscopy and CT volumes: one channel
STAGES = 4


def resnet3d_multiple(stages: int = STAGES) -> int:
    """Volume sides must be multiples of this: the stem's stride 2 times 2 per stage after the first."""
    return 2 ** stages


def blocks_for_depth(depth: int, stages: int = STAGES) -> tuple[int, ...]:
    """Basic blocks per stage of a ResNet of ``depth`` (its first ``stages`` stages); ValueError naming the depths."""
    blocks = BLOCKS.get(depth)
    if blocks is None:
        raise ValueError(f"depth {depth} is not a 3-D ResNet depth; use one of {', '.join(map(str, BLOCKS))}")
    if not 1 <= stages <= len(blocks):
        raise ValueError(f"stages={stages}: a 3-D ResNet has 1 to {len(blocks)} stages")
    return blocks[:stages]


class VolumeStem(nn.Module):
    """First layer: 3x3x3 convolution of stride 2 -> BatchNorm3d -> ReLU (halves every side)."""

    def __init__(self, in_channels: int, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv3d(in_channels, width, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm3d(width)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class VolumeHead(nn.Module):
    """Global average pool over the volume -> flatten -> linear: logits ``(N, classes)``."""

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten(self.pool(x)))


def resnet3d(depth: int = DEPTH, num_classes: int = 2, *, width: int = WIDTH, in_channels: int = IN_CHANNELS,
             stages: int = STAGES) -> list[nn.Module]:
    """The 3-D ResNet of ``depth`` (10, 18, 34) as a layer list: stem, basic blocks, head
    (``nn.Sequential(*layers)`` is the serial network)."""
    layers: list[nn.Module] = [VolumeStem(in_channels, width)]
    channels = width
    for stage, count in enumerate(blocks_for_depth(depth, stages)):
        out_channels = width * 2 ** stage
        for block in range(count):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append(BasicBlock(channels, out_channels, stride, VOLUME))
            channels = out_channels
    layers.append(VolumeHead(channels, num_classes))
    return layers
