"""The conv stack three benchmarks time: 3x3 convs (padding 1) each followed by a ReLU."""

from __future__ import annotations

from torch import nn


def conv_stack(channels: int = 16, layers: int = 3, in_channels: int = 3) -> nn.Sequential:
    """``layers`` x (3x3 conv to ``channels`` + ReLU): the spatial speed, halo and overlap benchmarks' model."""
    modules: list[nn.Module] = []
    cin = in_channels
    for _ in range(layers):
        modules += [nn.Conv2d(cin, channels, 3, padding=1), nn.ReLU()]
        cin = channels
    return nn.Sequential(*modules)
