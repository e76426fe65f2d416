"""``dl.infer_volume``: a trained 3-D network (a checkpoint or the model object) over a volume, window by window."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ..checkpoint.record import read_checkpoint
from ..config import ConfigError
from ..console import SetupLines
from ..spatial.geometry import TileGrid
from .fully_conv import FullyConvolutional, fully_convolutional
from .job import DTYPES, CheckedInfer
from .model import find_checkpoint
from .outputs.volume import VolumeOutputs
from .probes import input_channels
from .trained import check_streamable, load_network, refuse_volume_classifier
from .volume import VolumeRunner, VolumeSummary
from .volume_source import ArrayVolume, FileVolume, VolumeSource
from .whole_volume import whole_input_layer, whole_volume_network

if TYPE_CHECKING:
    from ..comm.protocol import Comm

Network = str | Path | nn.Module | Sequence[nn.Module]
DEFAULT_WINDOW = 64     # input voxels per rank per axis


def volume_network(network: Network, dtype: torch.dtype) -> FullyConvolutional:
    """A checkpoint's network (its path; a classifier refused) or a model object (an nn.Module or its layer list),
    fully convolutional (one that needs the whole volume: run as one window, ``whole_volume.py``)."""
    if isinstance(network, (str, Path)):
        file = find_checkpoint(network)
        record = read_checkpoint(file, lazy=True, check=False).record
        refuse_volume_classifier(record, file)
        return load_network(str(file), dtype=dtype).net
    layers = list(network) if not isinstance(network, nn.Module) else (
        list(network) if isinstance(network, nn.Sequential) else [network])
    if whole_input_layer(layers) is not None:
        return whole_volume_network([layer.to(dtype) for layer in layers])
    check_streamable(layers)
    layers = [layer.to(dtype).eval() for layer in layers]
    return fully_convolutional(layers, None, channels=input_channels(nn.Sequential(*layers)))


def volume_source(volume: str | Path | np.ndarray | VolumeSource) -> VolumeSource:
    if isinstance(volume, (str, Path)):
        return FileVolume(volume)
    if isinstance(volume, np.ndarray):
        return ArrayVolume(volume)
    return volume


@dataclass(frozen=True)
class VolumeRequest:
    """How to run a volume: its grid (``num_spatial_parts`` ranks cutting each window ``slice_method`` = DxRxC),
    input voxels per rank per axis, compute dtype and what to write."""

    num_spatial_parts: int
    slice_method: str
    window: int | Sequence[int]
    dtype: str
    probabilities: bool
    probability_dtype: str
    overwrite: bool
    progress: bool


def run_volume(network: Network, volume: str | Path | np.ndarray | VolumeSource, output: str | Path | None,
               request: VolumeRequest, ctx: Comm) -> VolumeSummary | None:
    """Collective: the network over ``volume`` as ``request`` asks; the summary on rank 0, None elsewhere (rank 0 says
    each part of the set-up as it starts, with progress on)."""
    if request.dtype not in DTYPES:
        raise ConfigError("--dtype", f"{request.dtype!r} is not one of {', '.join(DTYPES)}")
    torch_dtype = getattr(torch, request.dtype)
    setup = SetupLines("infer", request.progress and ctx.rank == 0)
    setup.doing(f"loading the network{f' {network}' if isinstance(network, (str, Path)) else ''}")
    net = volume_network(network, torch_dtype)
    setup.doing(f"opening the volume{f' {volume}' if isinstance(volume, (str, Path)) else ''}")
    source = volume_source(volume)
    outputs = None if output is None else VolumeOutputs.beside(
        output, net.shape.classes, request.probabilities, np.dtype(request.probability_dtype))
    grid = TileGrid.from_slice_method(request.slice_method, request.num_spatial_parts)
    runner = VolumeRunner(net, source, outputs, ctx, grid, request.window, dtype=torch_dtype,
                          progress=request.progress, overwrite=request.overwrite)
    return runner.run()


def run_volume_job(checked: CheckedInfer, ctx: Comm) -> VolumeSummary | None:
    """``infer --volume``: a checked job's checkpoint over its volume."""
    job = checked.job
    assert job.volume is not None       # a VOLUME job names its volume
    request = VolumeRequest(job.num_spatial_parts, job.volume_slice_method(), job.volume_window(), job.dtype,
                            probabilities=True, probability_dtype="float32", overwrite=job.overwrite,
                            progress=job.progress)
    return run_volume(checked.checkpoint, job.volume, job.outputs[0], request, ctx)


def infer_volume(network: Network, volume: str | Path | np.ndarray | VolumeSource, output: str | Path | None, *,
                 ctx: Comm | None = None, num_spatial_parts: int = 1, slice_method: str = "1x1x1",
                 window: int | Sequence[int] = DEFAULT_WINDOW, dtype: str = "float32", probabilities: bool = True,
                 probability_dtype: str = "float32", overwrite: bool = False,
                 progress: bool = False) -> dict[str, object] | None:
    """Run a 3-D network over ``volume`` (a TIFF stack or NIfTI path, an array ``(C, D, H, W)``), writing the label
    volume ``output`` (``.tif`` stack, ``.nii``, ``.nii.gz``) and, with ``probabilities``, ``NAME_prob<k>`` per class.

    Collective over ``num_spatial_parts`` ranks cutting each window ``slice_method`` = ``DxRxC``; ``window``: input
    voxels per rank per axis (N or (D, H, W)); a network that needs the whole volume (``whole_volume.WholeInput``,
    e.g. swinunetr3d) runs as one window, the whole volume, whatever ``window`` says. Every output voxel equals the
    network on the whole volume. A NIfTI scan is predicted in the RAS axes training reads it in, its outputs written
    back into its own voxel order, affine, codes and unit (they overlay it). Returns
    the summary on rank 0, None elsewhere; bad input raises ``ConfigError`` (``SetupFailed`` when one rank refused).
    """
    request = VolumeRequest(num_spatial_parts, slice_method, window, dtype, probabilities, probability_dtype,
                            overwrite, progress)
    if ctx is None:
        from ..comm.context import init

        ctx = init()
    summary = run_volume(network, volume, output, request, ctx)
    return summary.as_dict() if summary is not None else None
