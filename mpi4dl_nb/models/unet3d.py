"""The 3-D U-Net for volumes ``(N, C, D, H, W)``: ``unet`` with ``dims=3`` and small defaults."""
from __future__ import annotations

from torch import nn

from .unet import UNetNorm, Upsampling, unet

DEPTH = 2        # levels: volume sides must be multiples of 2 ** depth
WIDTH = 8        # channels of the first level (activations grow with the cube of the side: start small)
IN_CHANNELS = 1  # microscopy and CT volumes: one channel


def unet3d(depth: int = DEPTH, width: int = WIDTH, num_classes: int = 2, *, in_channels: int = IN_CHANNELS,
           norm: UNetNorm | str = UNetNorm.BATCH,
           upsampling: Upsampling | str = Upsampling.TRILINEAR) -> list[nn.Module]:
    """A 3-D U-Net of ``depth`` levels as ``2 * depth + 2`` layers (Down, Bottleneck, Up, the 1x1x1 head), with
    BatchNorm3d or GroupNorm and trilinear or transposed-convolution up-sampling; its logits
    ``(N, classes, D, H, W)`` are as large as the volume (see ``models/unet.py``)."""
    return unet(depth, width, num_classes, in_channels=in_channels, norm=norm, upsampling=upsampling, dims=3)
