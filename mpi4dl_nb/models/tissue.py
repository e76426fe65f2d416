"""The tissue mask travelling with a sample through a trunk: each layer runs on the image channels, the mask (the
input's last channel) is area-pooled to the layer's output grid and carried on as its last channel."""
from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn


class TissueCarrier(nn.Module):
    """``layer`` on all channels but the last; the last (tissue fraction) area-pooled by ``stride`` and appended.

    On tiles the area pool is a spatial average pool, exact when every tile's sides are multiples of the
    trunk's stride product (``models/canvas.py`` checks the canvas).
    """

    def __init__(self, layer: nn.Module, stride: int, in_channels: int) -> None:
        super().__init__()
        self.layer = layer
        self.stride = stride
        self.in_channels = in_channels   # the layer's channels and the mask: what shape probes feed it
        self.area = nn.AvgPool2d(stride) if stride > 1 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.layer(x[:, :-1]), self.area(x[:, -1:])], 1)


def layer_strides(layers: Sequence[nn.Module], in_channels: int, side: int) -> list[tuple[int, int]]:
    """Each layer's down-sampling factor and input channels, from shapes on the ``meta`` device (``side``: a square
    input's side)."""
    x = torch.empty(1, in_channels, side, side, device="meta")
    strides = []
    with torch.no_grad():
        for layer in layers:
            probe = copy.deepcopy(layer).to("meta").eval()
            y = probe(x)
            if side % int(y.shape[-1]) or x.shape[-1] % y.shape[-1]:
                raise ValueError(f"{type(layer).__name__} maps {tuple(x.shape[-2:])} to {tuple(y.shape[-2:])}: "
                                 f"not a whole stride; a tissue mask cannot follow it")
            strides.append((int(x.shape[-1]) // int(y.shape[-1]), int(x.shape[1])))
            x = y
    return strides


def carry_tissue(trunk: Sequence[nn.Module], in_channels: int, side: int) -> list[nn.Module]:
    """``trunk``'s layers each wrapped in a ``TissueCarrier`` of its stride (probed at ``side``)."""
    return [TissueCarrier(layer, stride, channels + 1)
            for layer, (stride, channels) in zip(trunk, layer_strides(trunk, in_channels, side))]
