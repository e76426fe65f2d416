"""What ``spatialize`` knows: torch layers with a spatial version, layers that act per pixel, and layers
whose functional op the op guard computes on tiles."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from . import mil_pool  # noqa: F401  (registers softmax_pool with the op guard)
from .conv import SpatialConv2d
from .convtranspose import SpatialConvTranspose2d, SpatialConvTranspose3d
from .norm import SpatialBatchNorm2d, SpatialBatchNorm3d, SpatialGroupNorm, SpatialInstanceNorm2d, SpatialInstanceNorm3d
from .pool import (
                   SpatialAvgPool2d,
                   SpatialGlobalAvgPool2d,
                   SpatialGlobalAvgPool3d,
                   SpatialGlobalMaxPool3d,
                   SpatialMaxPool2d,
)
from .upsample import SpatialUpsample
from .volume_window import SpatialAvgPool3d, SpatialConv3d, SpatialMaxPool3d

# torch layer type -> ``from_module(layer, runtime, name)`` of its spatial version, which is built
# around the torch layer's own parameters and buffers
SPATIAL_LAYERS: dict[type[nn.Module], Callable[..., nn.Module]] = {
    nn.Conv2d: SpatialConv2d.from_module,
    nn.ConvTranspose2d: SpatialConvTranspose2d.from_module,
    nn.MaxPool2d: SpatialMaxPool2d.from_module,
    nn.AvgPool2d: SpatialAvgPool2d.from_module,
    nn.BatchNorm2d: SpatialBatchNorm2d.from_module,
    nn.GroupNorm: SpatialGroupNorm.from_module,
    nn.InstanceNorm2d: SpatialInstanceNorm2d.from_module,
    nn.AdaptiveAvgPool2d: SpatialGlobalAvgPool2d.from_module,
    nn.Upsample: SpatialUpsample.from_module,
}

# The same for a volume's tiles (a TileGrid with depth); dropout runs as on images (GUARDED: the guard
# computes each tile's slice of the serial mask)
VOLUME_LAYERS: dict[type[nn.Module], Callable[..., nn.Module]] = {
    nn.Conv3d: SpatialConv3d.from_module,
    nn.ConvTranspose3d: SpatialConvTranspose3d.from_module,
    nn.MaxPool3d: SpatialMaxPool3d.from_module,
    nn.AvgPool3d: SpatialAvgPool3d.from_module,
    nn.BatchNorm3d: SpatialBatchNorm3d.from_module,
    nn.GroupNorm: SpatialGroupNorm.from_module,
    nn.InstanceNorm3d: SpatialInstanceNorm3d.from_module,
    nn.AdaptiveAvgPool3d: SpatialGlobalAvgPool3d.from_module,
    nn.AdaptiveMaxPool3d: SpatialGlobalMaxPool3d.from_module,
    nn.Upsample: SpatialUpsample.from_module,
}

# Layers that act on each pixel (or on replicated, already pooled tensors) independently.
# They run under the op guard, which refuses them on tiles when they are not (nn.Linear).
ELEMENTWISE: tuple[type, ...] = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU,
    nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh,
    nn.Softplus, nn.Flatten, nn.Linear, nn.PReLU, nn.Softmax, nn.LogSoftmax, nn.ChannelShuffle,
)

# Torch layers that run as they are: the op guard computes their functional op exactly on tiles
# (dropout: the serial mask's slice; LayerNorm/RMSNorm over channels-last tiles; a max pool to 1x1:
# over the whole image; a Conv1d on pooled values, as ECA's gate) or refuses it, naming the layer.
# Never fused into halo-D2 blocks.
GUARDED: tuple[type, ...] = (
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
    nn.LayerNorm, nn.RMSNorm, nn.AdaptiveMaxPool2d, nn.Conv1d,
)
