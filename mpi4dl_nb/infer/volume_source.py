"""Where volume inference reads its voxels: a Protocol (shape, channels, voxel size, scan space, region reads), an
in-memory volume and a file (a NIfTI scan read in RAS axes, its header kept for the outputs); boxes that leave the
volume read as zeros (the zero extension to the window unit)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ..data.volume.space import ScanSpace
from .windows import Extent

VoxelSize = tuple[float, float, float]     # µm along (z, y, x)


class VolumeSource(Protocol):
    """A ``(C, D, H, W)`` volume read region by region."""

    @property
    def shape(self) -> tuple[int, int, int]:
        """(depth, height, width) in voxels."""
        ...

    @property
    def channels(self) -> int: ...

    @property
    def voxel_size(self) -> VoxelSize | None: ...

    @property
    def name(self) -> str: ...

    @property
    def space(self) -> ScanSpace | None:
        """A NIfTI scan's grid and header, for outputs that overlay it (None: a TIFF stack or an array)."""
        ...

    def read(self, region: Extent) -> np.ndarray:
        """The ``(C, d, h, w)`` voxels of ``region`` (inside the volume)."""
        ...


@dataclass(frozen=True)
class ArrayVolume:
    """A volume held in memory (``(C, D, H, W)`` or ``(D, H, W)``): the Python API and the tests. ``space``: the NIfTI
    scan it was read from (``VolumeInfo.space``; the array in the axes that scan reads in), for outputs that overlay
    it."""

    array: np.ndarray
    voxel_size: VoxelSize | None = None
    name: str = "<array>"
    space: ScanSpace | None = None

    def __post_init__(self) -> None:
        if self.array.ndim == 3:
            object.__setattr__(self, "array", self.array[None])
        if self.array.ndim != 4:
            raise ValueError(f"a volume is (C, D, H, W) or (D, H, W), got shape {self.array.shape}")
        if self.space is not None and self.space.orientation.read_shape(self.space.grid_shape) != self.shape:
            raise ValueError(f"a {self.shape} volume is not read from a scan of grid {self.space.grid_shape}")

    @property
    def shape(self) -> tuple[int, int, int]:
        _, depth, height, width = self.array.shape
        return (int(depth), int(height), int(width))

    @property
    def channels(self) -> int:
        return int(self.array.shape[0])

    def read(self, region: Extent) -> np.ndarray:
        return np.asarray(self.array[(slice(None), *(slice(a, b) for a, b in region))])


def read_zero_extended(source: VolumeSource, region: Extent) -> np.ndarray:
    """``region``'s voxels, zeros where it leaves the volume (its end may pass the volume's sides)."""
    inside = tuple((min(a, n), min(b, n)) for (a, b), n in zip(region, source.shape))
    sizes = tuple(b - a for a, b in region)
    if all(b - a == size for (a, b), size in zip(inside, sizes)):
        return source.read(region)
    out = np.zeros((source.channels, *sizes), dtype=np.float64)
    if all(b > a for a, b in inside):
        values = source.read(inside)
        out = out.astype(values.dtype, copy=False)
        out[(slice(None), *(slice(0, b - a) for a, b in inside))] = values
    return out


class FileVolume:
    """A TIFF stack or NIfTI file (``data/volume/files.py``): the header once, each region read alone.

    Voxel values reach the network as training reads them: integer voxels divided by their type's
    maximum (``volume/dataset.intensity_scale``), float voxels as stored.
    """

    def __init__(self, path: str | Path) -> None:
        from ..data.volume.files import volume_info

        self.path = Path(path)
        self.info = volume_info(self.path)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.info.shape

    @property
    def channels(self) -> int:
        return self.info.channels

    @property
    def voxel_size(self) -> VoxelSize | None:
        return self.info.voxel_size

    @property
    def name(self) -> str:
        return str(self.path)

    @property
    def space(self) -> ScanSpace | None:
        return self.info.space

    def read(self, region: Extent) -> np.ndarray:
        from ..data.volume.dataset import intensity_scale
        from ..data.volume.files import read_volume

        voxels = read_volume(self.path, (slice(*region[0]), slice(*region[1]), slice(*region[2])))
        scale = intensity_scale(self.info.dtype)
        return voxels if scale == 1 else voxels / scale
