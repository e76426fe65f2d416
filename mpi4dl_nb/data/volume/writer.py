"""Label and probability volumes written box by box through a memory map: TIFF stacks (ImageJ spacing) or NIfTI.

A TIFF stack is one contiguous, uncompressed ImageJ hyperstack (``tifffile.memmap``): Z slices
with the voxel size as ImageJ reads it (X/Y resolution in pixels per µm, ``spacing`` in µm). A
``.nii`` is a NIfTI-1 header followed by the voxels, memory-mapped in place (NIfTI's x-fastest order
is a C-ordered grid ``(k, j, i)``). The output of a NIfTI scan (``space``: its ``ScanSpace`` at the
network's stride) is written in the scan's own grid with its qform, sform, codes and unit, boxes given
in the axes it was read in (``orientation.py``) put back exactly, so it overlays the scan in any viewer;
otherwise the grid is the ``(D, H, W)`` written, with the voxel size in the pixel dimensions, unit
micron, a diagonal affine. A ``.nii.gz`` cannot be written in place (gzip is a stream): the volume is
written as a ``.nii`` beside it, then compressed stream-wise on ``close`` and the ``.nii``
removed, so memory stays flat and the disk holds the uncompressed volume once meanwhile.
"""

from __future__ import annotations

import gzip
import importlib
import shutil
from enum import Enum
from pathlib import Path
from types import ModuleType

import numpy as np

from ...errors import ConfigError
from .orientation import GRID
from .space import ScanSpace

Region = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]   # half-open (depth, rows, columns)
VoxelSize = tuple[float, float, float]                                 # µm along (z, y, x)
NIFTI_OFFSET = 352        # a NIfTI-1 header (348 bytes) and an empty extension flag (4)
COPY_CHUNK = 1 << 24      # bytes per read while compressing a .nii.gz
IMAGEJ_TYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.float32))   # what ImageJ hyperstacks hold


class VolumeFormat(Enum):
    """How a volume file is written, from its name."""

    TIFF = "tiff"
    NIFTI = "nii"
    NIFTI_GZ = "nii.gz"


def volume_format(path: Path, knob: str = "--output") -> VolumeFormat:
    """The format a volume's file name asks for (``.tif``/``.tiff``, ``.nii``, ``.nii.gz``)."""
    name = path.name.lower()
    if name.endswith(".nii.gz"):
        return VolumeFormat.NIFTI_GZ
    if name.endswith(".nii"):
        return VolumeFormat.NIFTI
    if name.endswith((".tif", ".tiff")):
        return VolumeFormat.TIFF
    raise ConfigError(knob, f"{path}: a volume is written as a TIFF stack (.tif, .tiff) or NIfTI (.nii, "
                            f".nii.gz); name the file with one of these endings")


def label_dtype(classes: int) -> np.dtype:
    """The smallest unsigned integer type holding every class index."""
    return np.dtype(np.uint8 if classes <= 256 else np.uint16)


class VolumeWriter:
    """A ``(D, H, W)`` volume of ``dtype`` filled region by region; ``close`` finishes the file. ``voxel_size``: µm
    along ``D, H, W``; ``space``: the scan's grid and header the volume is written back into (None: written as
    ``D, H, W``)."""

    def __init__(self, path: Path, shape: tuple[int, int, int], dtype: np.dtype,
                 voxel_size: VoxelSize | None, space: ScanSpace | None = None) -> None:
        self.path, self.shape, self.dtype = Path(path), shape, np.dtype(dtype)
        self.orientation = GRID if space is None else space.orientation
        grid = self.orientation.grid_shape(shape)
        if space is not None and space.grid_shape != grid:
            raise ValueError(f"a {shape} volume is not read from the scan grid {space.grid_shape}")
        grid_voxel = None if voxel_size is None else self.orientation.grid_shape(voxel_size)
        self.format = volume_format(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.format is VolumeFormat.TIFF:
            self.array = _tiff_memmap(self.path, grid, self.dtype, grid_voxel)
            self.mapped = self.path
        else:
            self.mapped = self.path.with_name(self.path.name[:-3]) if self.format is VolumeFormat.NIFTI_GZ \
                else self.path
            self.array = _nifti_memmap(self.mapped, grid, self.dtype, grid_voxel, space)

    def write(self, region: Region, values: np.ndarray) -> None:
        """``values`` ``(d, h, w)`` into the half-open ``region`` of the ``(D, H, W)`` volume."""
        ranges = tuple(range(a, b) for a, b in region)
        z, y, x = self.orientation.grid_ranges((ranges[0], ranges[1], ranges[2]), self.shape)
        self.array[z.start:z.stop, y.start:y.stop, x.start:x.stop] = self.orientation.to_grid(values)

    def close(self) -> None:
        self.array.flush()
        del self.array
        if self.format is VolumeFormat.NIFTI_GZ:
            with open(self.mapped, "rb") as source, gzip.open(self.path, "wb", compresslevel=4) as target:
                shutil.copyfileobj(source, target, COPY_CHUNK)
            self.mapped.unlink()


def _package(name: str, path: Path) -> ModuleType:
    """``name`` imported, or a ConfigError saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ConfigError("--output", f"{path} needs the Python package {name}: "
                                      f"pip install -e '.[volumes]'") from None


def _tiff_memmap(path: Path, shape: tuple[int, int, int], dtype: np.dtype,
                 voxel_size: VoxelSize | None) -> np.memmap:
    tifffile = _package("tifffile", path)

    metadata: dict[str, object] = {"axes": "ZYX"}
    resolution = None
    if voxel_size is not None:
        z, y, x = voxel_size
        metadata.update(spacing=z, unit="um")
        resolution = (1.0 / x, 1.0 / y)
    imagej = dtype in IMAGEJ_TYPES     # other types (float64): a plain stack, the voxel size in its metadata
    return tifffile.memmap(str(path), shape=shape, dtype=dtype, imagej=imagej, resolution=resolution,
                           metadata=metadata)


def _nifti_memmap(path: Path, shape: tuple[int, int, int], dtype: np.dtype,
                  voxel_size: VoxelSize | None, space: ScanSpace | None) -> np.memmap:
    """A NIfTI of grid ``shape`` (k, j, i) placed as ``space`` says, else by ``voxel_size`` µm on a diagonal."""
    nibabel = _package("nibabel", path)

    depth, height, width = shape
    header = nibabel.Nifti1Header()
    header.set_data_shape((width, height, depth))
    header.set_data_dtype(dtype.newbyteorder("<"))
    if space is not None:
        space.write_into(header)
    else:
        z, y, x = voxel_size if voxel_size is not None else (1.0, 1.0, 1.0)
        header.set_zooms((x, y, z))
        header.set_xyzt_units(xyz="micron" if voxel_size is not None else "unknown")
        affine = np.diag([x, y, z, 1.0])
        header.set_qform(affine, code=1)
        header.set_sform(affine, code=1)
    header["vox_offset"] = NIFTI_OFFSET
    with open(path, "wb") as handle:
        header.write_to(handle)
        handle.write(b"\0" * (NIFTI_OFFSET - handle.tell()))
        handle.truncate(NIFTI_OFFSET + depth * height * width * dtype.itemsize)
    return np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r+", offset=NIFTI_OFFSET, shape=shape)
