"""The exact map between a volume file's stored voxel grid and the RAS axes every oriented volume is read in.

A file's *grid* is its voxels as stored, ``(k, j, i)``: a TIFF stack's pages, rows, columns; a NIfTI's array
``(i, j, k)`` transposed (the ``z, y, x`` of its own axes). A NIfTI that states its axes (a qform or sform code)
is read in RAS axes, ``(D, H, W)`` = inferior to superior, posterior to anterior, left to right: the stored axes
swapped and reversed to the world axes closest to them (nibabel's ``io_orientation``) — no resampling, so reading
and writing back are exact. An oblique grid (its axes rotated off the world's) keeps its voxels too: it is read in
its closest RAS axes, the residual rotation (``oblique_degrees``) said, not resampled away. A volume that states
no axes (TIFF, a NIfTI with both codes 0) is read as its grid (``GRID``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np

Shape = tuple[int, int, int]
Side = TypeVar("Side", int, float)       # what a per-axis triple holds: voxels, or a voxel's size
Ranges = tuple[range, range, range]
OBLIQUE_DEGREES = 0.01       # a grid rotated off its closest world axes by more is called oblique
WORLD_OF_READ_AXIS = (2, 1, 0)   # D, H, W run along the world's S, A, R (axes 2, 1, 0 of RAS)


@dataclass(frozen=True)
class Orientation:
    """Where each read axis (D, H, W) lies in the file's grid, and whether it runs against it."""

    grid_axes: tuple[int, int, int] = (0, 1, 2)                 # for D, H, W: the grid axis it is
    reversed: tuple[bool, bool, bool] = (False, False, False)   # for D, H, W: read against the grid's direction
    codes: str = ""               # where the stored axes i, j, k point ("LAS", "LPS", ...); "" when not stated
    oblique_degrees: float = 0.0  # the largest angle between a stored axis and its closest world axis

    @property
    def stated(self) -> bool:
        """Whether the file says where its axes point (else it is read as its grid)."""
        return bool(self.codes)

    @property
    def reorients(self) -> bool:
        """Whether reading swaps or reverses any of the grid's axes."""
        return self.grid_axes != (0, 1, 2) or any(self.reversed)

    @property
    def oblique(self) -> bool:
        return self.oblique_degrees > OBLIQUE_DEGREES

    def read_shape(self, grid_shape: tuple[Side, Side, Side]) -> tuple[Side, Side, Side]:
        """The sides along ``(D, H, W)`` of a grid of ``grid_shape`` (voxels, or voxel sizes)."""
        return grid_shape[self.grid_axes[0]], grid_shape[self.grid_axes[1]], grid_shape[self.grid_axes[2]]

    def grid_shape(self, read_shape: tuple[Side, Side, Side]) -> tuple[Side, Side, Side]:
        """The grid's sides whose read sides are ``read_shape``."""
        back = [self.grid_axes.index(g) for g in range(3)]
        return read_shape[back[0]], read_shape[back[1]], read_shape[back[2]]

    def grid_ranges(self, ranges: Ranges, read_shape: Shape) -> Ranges:
        """The grid's index ranges holding the read ranges ``ranges`` of a ``read_shape`` volume."""
        found = [range(0), range(0), range(0)]
        for part, size, g, back in zip(ranges, read_shape, self.grid_axes, self.reversed, strict=True):
            found[g] = range(size - part.stop, size - part.start) if back else part
        return found[0], found[1], found[2]

    def to_read(self, block: np.ndarray) -> np.ndarray:
        """A grid block (its last three axes the grid's) in read axes, leading axes kept."""
        lead = block.ndim - 3
        out = block.transpose(*range(lead), *(lead + g for g in self.grid_axes))
        flips = tuple(lead + a for a, back in enumerate(self.reversed) if back)
        return np.flip(out, flips) if flips else out

    def to_grid(self, block: np.ndarray) -> np.ndarray:
        """A read block (its last three axes D, H, W) in the grid's axes: ``to_read`` undone."""
        lead = block.ndim - 3
        flips = tuple(lead + a for a, back in enumerate(self.reversed) if back)
        out = np.flip(block, flips) if flips else block
        return out.transpose(*range(lead), *(lead + self.grid_axes.index(g) for g in range(3)))

    def describe(self) -> str:
        """``LAS``, ``LPS, oblique 12.0°``, or ``no stated axes``."""
        if not self.stated:
            return "no stated axes"
        return self.codes + (f", oblique {self.oblique_degrees:.1f}°" if self.oblique else "")


GRID = Orientation()


def orientation_of(affine: np.ndarray) -> Orientation:
    """The RAS reading of a grid whose stored axes ``(i, j, k)`` the 4x4 ``affine`` places in the world; ValueError
    for an affine that collapses an axis."""
    from nibabel.orientations import io_orientation, ornt2axcodes

    affine = np.asarray(affine, dtype=np.float64)
    columns = affine[:3, :3]
    norms = np.linalg.norm(columns, axis=0)
    if not np.isfinite(affine).all() or (norms == 0).any():
        raise ValueError(f"its affine maps a voxel axis to no direction ({np.round(affine[:3], 4).tolist()})")
    ornt = io_orientation(affine)
    if np.isnan(ornt).any():
        raise ValueError(f"its affine has no clear direction for every voxel axis ({np.round(affine[:3], 4).tolist()})")
    world = [int(w) for w in ornt[:, 0]]
    grid_axes, back = [], []
    for world_axis in WORLD_OF_READ_AXIS:
        stored = world.index(world_axis)          # stored axis i, j or k (0, 1, 2) along that world axis
        grid_axes.append(2 - stored)              # the grid is (k, j, i)
        back.append(bool(ornt[stored, 1] < 0))
    cosines = np.clip(np.abs(columns / norms).max(axis=0), 0.0, 1.0)
    degrees = float(np.degrees(np.arccos(cosines.min())))
    return Orientation((grid_axes[0], grid_axes[1], grid_axes[2]), (back[0], back[1], back[2]),
                       "".join(str(c) for c in ornt2axcodes(ornt)), degrees)


def paired_orientation(image: Orientation, labels: Orientation) -> Orientation:
    """How a label volume is read beside its image: placed by its own affine when both state their axes, else
    voxel for voxel with the image's grid (read as the image is)."""
    return labels if image.stated and labels.stated else image
