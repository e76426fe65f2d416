"""SpatialUpsample: nn.Upsample on tiles (the resampling itself is in interpolate.py)."""

from __future__ import annotations

import torch
from torch import nn

from .interpolate import ResampleArgs, interpolate_tile
from .layer import SpatialLayer, SpatialRuntime, adopt


class SpatialUpsample(SpatialLayer, nn.Upsample):
    """nn.Upsample on this rank's tile: the owned tile of the upsampled image."""

    @classmethod
    def from_module(cls, up: nn.Upsample, runtime: SpatialRuntime, name: str = "") -> SpatialUpsample:
        return adopt(cls, up, runtime, name)

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        return interpolate_tile(self.runtime, self, x, ResampleArgs.of(self), self.layer_name)
