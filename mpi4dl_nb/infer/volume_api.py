"""``dl.infer_volume``: a trained 3-D network (a checkpoint or the model object) over a volume, window by window."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ..config import ConfigError
from ..spatial.geometry import TileGrid
from .fully_conv import FullyConvolutional, fully_convolutional
from .probes import input_channels
from .settings import DTYPES
from .trained import check_streamable, load_network
from .volume import VolumeRunner
from .volume_outputs import VolumeOutputs
from .volume_source import ArrayVolume, FileVolume, VolumeSource

if TYPE_CHECKING:
    from ..comm.protocol import Comm

Network = str | Path | nn.Module | Sequence[nn.Module]
DEFAULT_WINDOW = 64     # input voxels per rank per axis


def volume_network(network: Network, dtype: torch.dtype) -> FullyConvolutional:
    """A checkpoint's network (its path) or a model object (an nn.Module or its layer list), fully convolutional."""
    if isinstance(network, (str, Path)):
        return load_network(str(network), dtype=dtype).net
    layers = list(network) if not isinstance(network, nn.Module) else (
        list(network) if isinstance(network, nn.Sequential) else [network])
    check_streamable(layers)
    layers = [layer.to(dtype).eval() for layer in layers]
    return fully_convolutional(layers, None, channels=input_channels(nn.Sequential(*layers)))


def volume_source(volume: str | Path | np.ndarray | VolumeSource) -> VolumeSource:
    if isinstance(volume, (str, Path)):
        return FileVolume(volume)
    if isinstance(volume, np.ndarray):
        return ArrayVolume(volume)
    return volume


def infer_volume(network: Network, volume: str | Path | np.ndarray | VolumeSource, output: str | Path | None, *,
                 ctx: Comm | None = None, num_spatial_parts: int = 1, slice_method: str = "1x1x1",
                 window: int | Sequence[int] = DEFAULT_WINDOW, dtype: str = "float32", probabilities: bool = True,
                 probability_dtype: str = "float32", overwrite: bool = False,
                 progress: bool = False) -> dict[str, object] | None:
    """Run a 3-D network over ``volume`` (a TIFF stack or NIfTI path, an array ``(C, D, H, W)``), writing the label
    volume ``output`` (``.tif`` stack, ``.nii``, ``.nii.gz``) and, with ``probabilities``, ``NAME_prob<k>`` per class.

    Collective over ``num_spatial_parts`` ranks cutting each window ``slice_method`` = ``DxRxC``; ``window``: input
    voxels per rank per axis (N or (D, H, W)). Every output voxel equals the network on the whole volume. Returns
    the summary on rank 0, None elsewhere; bad input raises ``ConfigError`` (``SetupFailed`` when one rank refused).
    """
    if dtype not in DTYPES:
        raise ConfigError("--dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}")
    torch_dtype = getattr(torch, dtype)
    net = volume_network(network, torch_dtype)
    source = volume_source(volume)
    outputs = None if output is None else VolumeOutputs.beside(
        output, net.shape.classes, probabilities, np.dtype(probability_dtype))
    if ctx is None:
        from ..comm.context import init

        ctx = init()
    grid = TileGrid.from_slice_method(slice_method, num_spatial_parts)
    runner = VolumeRunner(net, source, outputs, ctx, grid, window, dtype=torch_dtype, progress=progress,
                          overwrite=overwrite)
    summary = runner.run()
    return summary.as_dict() if summary is not None else None
