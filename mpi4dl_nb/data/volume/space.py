"""Where a NIfTI scan's voxels lie in the world, as its header says: the qform and sform with their codes, the voxel
size and its unit; read from a scan, and carried (at the network's stride) into the outputs that overlay it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .orientation import GRID, Orientation, Shape, orientation_of

if TYPE_CHECKING:
    from nibabel.nifti1 import Nifti1Header

Matrix = tuple[tuple[float, ...], ...]      # a 4x4 affine, row by row


def _matrix(array: np.ndarray) -> Matrix:
    return tuple(tuple(float(v) for v in row) for row in np.asarray(array, dtype=np.float64))


@dataclass(frozen=True)
class ScanSpace:
    """A NIfTI's grid ``(k, j, i)`` and the header fields placing it in the world (qform, sform, codes, unit)."""

    grid_shape: Shape
    zooms: tuple[float, float, float]     # voxel size along i, j, k, in ``unit``
    unit: str                             # nibabel's spatial unit name: "mm", "micron", "meter", "unknown"
    qform: Matrix
    qform_code: int
    sform: Matrix
    sform_code: int

    @staticmethod
    def of_header(header: Nifti1Header, grid_shape: Shape) -> ScanSpace:
        zooms = header.get_zooms()
        return ScanSpace(grid_shape, (float(zooms[0]), float(zooms[1]), float(zooms[2])),
                         str(header.get_xyzt_units()[0]), _matrix(header.get_qform()), int(header["qform_code"]),
                         _matrix(header.get_sform()), int(header["sform_code"]))

    @property
    def affine(self) -> np.ndarray | None:
        """The voxel-to-world map a reader uses (the sform when coded, else the qform when coded), None when the
        header states neither."""
        if self.sform_code > 0:
            return np.array(self.sform)
        if self.qform_code > 0:
            return np.array(self.qform)
        return None

    @property
    def orientation(self) -> Orientation:
        """How the grid is read (RAS axes; ``GRID`` when no axes are stated); ValueError for a collapsed axis."""
        affine = self.affine
        return GRID if affine is None else orientation_of(affine)

    def at_stride(self, strides: Shape) -> ScanSpace:
        """The space of an output of one cell per ``strides`` voxels along the read axes ``(D, H, W)`` (cells from
        the read volume's start, the last one past its end when a side is not a multiple): each cell placed at the
        centre of its voxels, so a reversed axis starts from the other end."""
        orientation = self.orientation
        if strides == (1, 1, 1):
            return self
        step = np.eye(4)
        shape = list(self.grid_shape)
        zooms = list(self.zooms)
        for stride, g, back in zip(strides, orientation.grid_axes, orientation.reversed, strict=True):
            voxels, stored = self.grid_shape[g], 2 - g          # the grid (k, j, i) against the affine's (i, j, k)
            cells = -(-voxels // stride)
            step[stored, stored] = stride
            centre = (stride - 1) / 2
            step[stored, 3] = voxels - 1 - (cells - 1) * stride - centre if back else centre
            shape[g] = cells
            zooms[stored] *= stride
        return ScanSpace((shape[0], shape[1], shape[2]), (zooms[0], zooms[1], zooms[2]), self.unit,
                         _matrix(np.array(self.qform) @ step), self.qform_code,
                         _matrix(np.array(self.sform) @ step), self.sform_code)

    def write_into(self, header: Nifti1Header) -> None:
        """Set ``header``'s voxel size, unit, qform and sform (with their codes) to this space's."""
        header.set_zooms(self.zooms)
        header.set_xyzt_units(xyz=self.unit)
        if self.qform_code > 0:
            header.set_qform(np.array(self.qform), code=self.qform_code)
        else:
            header.set_qform(None, code=0)
        header.set_sform(np.array(self.sform), code=self.sform_code)
