"""U-Net (depth, width, BatchNorm or GroupNorm, bilinear or transposed-conv up-sampling) as a layer list, 2-D or 3-D.
More: docs/segmentation.md#notes-by-module."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..config import Choice, parse_choice

State = torch.Tensor | tuple[torch.Tensor, ...]
GROUPS = 8      # GroupNorm groups (fewer when the channels are not a multiple)


class UNetNorm(Choice):
    """The normalisation after each convolution."""

    BATCH = "batch"
    GROUP = "group"


class Upsampling(Choice):
    """How the decoder doubles the resolution."""

    BILINEAR = "bilinear"       # nn.Upsample(scale_factor=2, mode="bilinear") (images)
    TRILINEAR = "trilinear"     # nn.Upsample(scale_factor=2, mode="trilinear") (volumes)
    TRANSPOSED = "transposed"   # nn.ConvTranspose2d / 3d (kernel 2, stride 2)


@dataclass(frozen=True)
class Layers:
    """The layer classes of one spatial dimensionality: images (2) or volumes (3)."""

    conv: type[nn.Conv2d] | type[nn.Conv3d]
    batch_norm: type[nn.BatchNorm2d] | type[nn.BatchNorm3d]
    max_pool: type[nn.MaxPool2d] | type[nn.MaxPool3d]
    transposed: type[nn.ConvTranspose2d] | type[nn.ConvTranspose3d]
    interpolation: Upsampling   # the Upsample mode of this dimensionality


LAYERS = {2: Layers(nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d, nn.ConvTranspose2d, Upsampling.BILINEAR),
          3: Layers(nn.Conv3d, nn.BatchNorm3d, nn.MaxPool3d, nn.ConvTranspose3d, Upsampling.TRILINEAR)}


def _norm(kind: UNetNorm, channels: int, dims: Layers) -> nn.Module:
    if kind is UNetNorm.BATCH:
        return dims.batch_norm(channels)
    return nn.GroupNorm(math.gcd(GROUPS, channels), channels)


def _parts(state: State) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x, *skips = state if isinstance(state, tuple) else (state,)
    return x, skips


class DoubleConv(nn.Module):
    """Two 3x3 (3x3x3) convolutions, each followed by the norm and a ReLU."""

    def __init__(self, cin: int, cout: int, norm: UNetNorm, dims: Layers = LAYERS[2]) -> None:
        super().__init__()
        self.body = nn.Sequential(dims.conv(cin, cout, 3, 1, 1, bias=False), _norm(norm, cout, dims), nn.ReLU(),
                                  dims.conv(cout, cout, 3, 1, 1, bias=False), _norm(norm, cout, dims), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Down(nn.Module):
    """An encoder level: ``(x, *skips) -> (pool(y), *skips, y)``."""

    def __init__(self, cin: int, cout: int, norm: UNetNorm, dims: Layers = LAYERS[2]) -> None:
        super().__init__()
        self.conv = DoubleConv(cin, cout, norm, dims)
        self.pool = dims.max_pool(2)

    def forward(self, state: State) -> tuple[torch.Tensor, ...]:
        x, skips = _parts(state)
        y = self.conv(x)
        return (self.pool(y), *skips, y)


class Bottleneck(nn.Module):
    """The lowest level: ``(x, *skips) -> (double_conv(x), *skips)``."""

    def __init__(self, cin: int, cout: int, norm: UNetNorm, dims: Layers = LAYERS[2]) -> None:
        super().__init__()
        self.conv = DoubleConv(cin, cout, norm, dims)

    def forward(self, state: State) -> State:
        x, skips = _parts(state)
        return (self.conv(x), *skips) if skips else self.conv(x)


class Up(nn.Module):
    """A decoder level: ``(x, *skips, skip) -> (double_conv(cat(up(x), skip)), *skips)``."""

    def __init__(self, cin: int, cskip: int, cout: int, upsampling: Upsampling, norm: UNetNorm,
                 dims: Layers = LAYERS[2]) -> None:
        super().__init__()
        if upsampling is Upsampling.TRANSPOSED:
            self.up: nn.Module = dims.transposed(cin, cskip, 2, 2)
            merged = 2 * cskip
        else:
            self.up = nn.Upsample(scale_factor=2, mode=str(dims.interpolation), align_corners=False)
            merged = cin + cskip
        self.conv = DoubleConv(merged, cout, norm, dims)

    def forward(self, state: State) -> State:
        x, skips = _parts(state)
        if not skips:
            raise ValueError("Up needs a skip connection: give it the (x, *skips) tuple of the level above")
        *rest, skip = skips
        y = self.conv(torch.cat([self.up(x), skip], dim=1))
        return (y, *rest) if rest else y


def unet(depth: int = 4, width: int = 16, num_classes: int = 2, *, in_channels: int = 3,
         norm: UNetNorm | str = UNetNorm.BATCH,
         upsampling: Upsampling | str = Upsampling.BILINEAR, dims: int = 2) -> list[nn.Module]:
    """A U-Net of ``depth`` levels as ``2 * depth + 2`` layers: ``depth`` Down, the Bottleneck, ``depth`` Up, the head.

    Level ``i`` has ``width * 2**i`` channels; the bottleneck ``width * 2**depth``. ``dims``: 2 for images,
    3 for volumes (``upsampling`` then 'trilinear' or 'transposed').
    """
    if dims not in LAYERS:
        raise ValueError(f"a U-Net is 2-D (images) or 3-D (volumes), got dims={dims}")
    layer_kinds = LAYERS[dims]
    if depth < 1 or width < 1 or num_classes < 1 or in_channels < 1:
        raise ValueError(f"a U-Net needs depth, width, classes and input channels >= 1, got {depth}, {width}, "
                         f"{num_classes}, {in_channels}")
    kind = parse_choice(UNetNorm, norm, "norm", f"one of {', '.join(UNetNorm.values())}")
    up = parse_choice(Upsampling, upsampling, "upsampling", f"one of {', '.join(Upsampling.values())}")
    if up not in (Upsampling.TRANSPOSED, layer_kinds.interpolation):
        raise ValueError(f"upsampling {str(up)!r} is not for a {dims}-D U-Net; use "
                         f"{str(layer_kinds.interpolation)!r} or 'transposed'")
    channels = [width * 2 ** i for i in range(depth + 1)]
    layers: list[nn.Module] = []
    cin = in_channels
    for level in range(depth):
        layers.append(Down(cin, channels[level], kind, layer_kinds))
        cin = channels[level]
    layers.append(Bottleneck(cin, channels[depth], kind, layer_kinds))
    for level in reversed(range(depth)):
        layers.append(Up(channels[level + 1], channels[level], channels[level], up, kind, layer_kinds))
    layers.append(layer_kinds.conv(channels[0], num_classes, 1))
    return layers
