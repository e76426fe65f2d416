"""Volumes at a voxel size: the area shrink of ``resolution.AreaResampler`` along each of z, y, x, and majority labels.

A volume of voxel size ``(z, y, x)`` µm read at ``--voxel-size`` is shrunk along each axis by its own scale
(target / source, >= 1: finer would invent detail). Every target voxel is the overlap-weighted mean of its
footprint, the taps in a fixed order, axis by axis (x, then y, then z), so any box of the result read alone is
bitwise the same box of the whole (a spatial rank's tile); labels take the class covering most of a footprint.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...errors import ConfigError
from ..dataset import VolumeBox
from ..resolution import LEVEL_TOLERANCE, AreaResampler

VolumeReader = Callable[[VolumeBox], np.ndarray]  # (C, d, h, w) of a box of the source (zeros past its edges)
VoxelSize = tuple[float, float, float]


def voxel_scales(source: VoxelSize | None, target: VoxelSize | None, where: str) -> tuple[float, float, float]:
    """The shrink along z, y, x that reads a volume of ``source`` µm voxels at ``target`` (1.0: as stored);
    ConfigError naming ``where`` for an unknown source size or a finer target."""
    if target is None:
        return (1.0, 1.0, 1.0)
    if source is None:
        raise ConfigError("--voxel-size", f"{where} does not say its voxel size (no OME PhysicalSize, ImageJ "
                                          f"spacing/resolution or NIfTI zooms with a unit); drop --voxel-size")
    scales = []
    for axis, have, want in zip("zyx", source, target, strict=True):
        if want < have * (1.0 - LEVEL_TOLERANCE):
            raise ConfigError("--voxel-size", f"{where} has {have:g} µm voxels along {axis}; {want:g} µm would "
                                              f"invent detail: use a {axis} size >= {have:g}")
        scale = want / have
        scales.append(1.0 if abs(scale - 1.0) <= LEVEL_TOLERANCE else scale)
    return scales[0], scales[1], scales[2]


@dataclass(frozen=True)
class VolumeResampler:
    """Shrink a volume by ``scales`` (z, y, x; each >= 1)."""

    scales: tuple[float, float, float]

    @property
    def resampled(self) -> bool:
        return any(s != 1.0 for s in self.scales)

    def extent(self, shape: tuple[int, int, int]) -> tuple[int, int, int]:
        """``(D, H, W)`` of the shrunk volume of ``shape`` voxels."""
        d, h, w = (AreaResampler(s).extent(n) if s != 1.0 else n for s, n in zip(self.scales, shape, strict=True))
        return d, h, w

    def source_box(self, box: VolumeBox) -> VolumeBox:
        """The source voxels ``box`` (target voxels) reads, with the taps' padding."""
        ranges = []
        for scale, (start, stop) in zip(self.scales, box, strict=True):
            if scale == 1.0:
                ranges.append((start, stop))
                continue
            low, high = AreaResampler(scale).source_range(start, stop)
            ranges.append((low, high + int(math.ceil(scale)) + 1))
        return tuple(ranges)

    def mean(self, source: np.ndarray, box: VolumeBox) -> np.ndarray:
        """float64 ``(C, d, h, w)`` of ``box``: each voxel the overlap-weighted mean of ``source`` (float64, the
        voxels of ``source_box(box)``), along x, then y, then z."""
        origin = self.source_box(box)
        out = source
        for axis in (3, 2, 1):
            scale, (start, stop) = self.scales[axis - 1], box[axis - 1]
            if scale == 1.0:
                continue
            taps, weights = AreaResampler(scale).taps(start, stop)
            shape = list(out.shape)
            shape[axis] = stop - start
            acc = np.zeros(shape, dtype=np.float64)
            along = [1] * out.ndim
            along[axis] = -1
            for t in range(taps.shape[1]):
                picked = np.take(out, taps[:, t] - origin[axis - 1][0], axis=axis)
                acc += weights[:, t].reshape(along) * picked
            out = acc
        return out

    def read(self, read_source: VolumeReader, box: VolumeBox) -> np.ndarray:
        """``box`` of the shrunk volume, float64 ``(C, d, h, w)``, from ``read_source(source box)``."""
        source = read_source(self.source_box(box)).astype(np.float64)
        return self.mean(source, box) if self.resampled else source

    def vote(self, read_source: VolumeReader, box: VolumeBox) -> np.ndarray:
        """``box`` of a shrunk label volume, int64 ``(d, h, w)``: each voxel the label covering most of its
        footprint (a tie goes to the smaller label); labels are chosen, never interpolated."""
        labels = np.asarray(read_source(self.source_box(box)))[0]
        if not self.resampled:
            return labels.astype(np.int64)
        shape = tuple(b - a for a, b in box)
        best = np.full(shape, -1.0)
        chosen = np.zeros(shape, dtype=np.int64)
        for value in np.unique(labels):              # ascending: a later label must cover strictly more
            share = self.mean((labels == value).astype(np.float64)[None], box)[0]
            more = share > best
            chosen[more], best[more] = int(value), share[more]
        return chosen
