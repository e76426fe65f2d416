"""A folder of ``images/`` volumes with their ``masks/`` label volumes (same names): patches of ``--image-size D,H,W``.

Each volume (multi-page TIFF stack or NIfTI, ``volume_files``; a NIfTI in RAS axes) gives one patch: its centre
``D x H x W`` voxels, at ``--voxel-size`` when given (``volume_resample``). ``read(index, box)`` reads only the box of
the patch (a spatial rank's tile) through ``read_volume(region=...)``: float ``(C, d, h, w)``, integer voxels
divided by their type's maximum (uint8 / 255 as for 2-D images), float voxels as stored. ``read_mask`` is int64
``(d, h, w)``: a label volume placed by its own affine when it and its image state their axes, else voxel for voxel
with its image (``orientation.paired_orientation``); ``orientation_note`` says what that reading changed, for the run
to say once. ``check_volume_pair`` is the check before the first step: the image a volume (not a 2-D image), its
label volume there, one channel of integers, of the image's size, every label a class or ``ignore_index`` (the
2-D masks' ``label_range_problem``).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...errors import ConfigError
from ..dataset import AnyBox, is_volume_box
from ..files import require_path
from ..groups import Groups
from ..masks import IMAGES, MASKS, label_range_problem
from .files import VolumeInfo, is_volume_file, read_volume, volume_info, volume_stem
from .groups import volume_groups
from .orientation import Orientation, paired_orientation
from .reoriented import reoriented_note
from .resample import VolumeBox, VolumeResampler, VoxelSize, voxel_scales

VolumeSize = tuple[int, int, int]         # (D, H, W) voxels
CHECK_SLAB = 16                           # depth slices of a label volume read at once by the check


def volume_images(root: Path) -> list[Path]:
    """Every file in ``root/images`` (sorted): volumes, and anything else the check then names."""
    return sorted(p for p in (root / IMAGES).iterdir() if p.is_file() and not p.name.startswith("."))


@functools.lru_cache(maxsize=8)
def label_volumes(folder: Path) -> dict[str, tuple[Path, ...]]:
    """The label volumes of ``folder`` by stem (``a.nii.gz`` -> ``a``)."""
    found: dict[str, list[Path]] = {}
    if folder.is_dir():
        for path in sorted(folder.iterdir()):
            if path.is_file() and is_volume_file(path):
                found.setdefault(volume_stem(path), []).append(path)
    return {stem: tuple(paths) for stem, paths in found.items()}


def label_volume_of(image: Path) -> Path:
    """The label volume of ``image`` (``../masks/<stem>.<tif|tiff|nii|nii.gz>``); ValueError when none or several."""
    found = label_volumes(image.parent.parent / MASKS).get(volume_stem(image), ())
    if not found:
        raise ValueError(f"no label volume {MASKS}/{volume_stem(image)}.{{tif,tiff,nii,nii.gz}} for "
                         f"{IMAGES}/{image.name}")
    if len(found) > 1:
        raise ValueError(f"{IMAGES}/{image.name} has {len(found)} label volumes ({', '.join(p.name for p in found)})"
                         f"; keep one")
    return found[0]


def volume_size_text(size: VolumeSize) -> str:
    return "x".join(map(str, size))


@dataclass(frozen=True)
class VolumePatch:
    """The centre ``size`` patch of a volume read at ``scales`` (``VolumeResampler``)."""

    info: VolumeInfo
    size: VolumeSize
    resampler: VolumeResampler

    @staticmethod
    def of(info: VolumeInfo, size: VolumeSize, voxel_size: VoxelSize | None) -> VolumePatch:
        return VolumePatch(info, size, VolumeResampler(voxel_scales(info.voxel_size, voxel_size, str(info.path))))

    @property
    def extent(self) -> VolumeSize:
        return self.resampler.extent(self.info.shape)

    def problem(self) -> str | None:
        """Why the patch does not fit the volume (None: it does)."""
        extent = self.extent
        if all(e >= s for e, s in zip(extent, self.size, strict=True)):
            return None
        fit = ",".join(str(min(e, s)) for e, s in zip(extent, self.size, strict=True))
        read = f"is {volume_size_text(self.info.shape)} voxels (DxHxW)" + (
            f", {volume_size_text(extent)} at --voxel-size" if self.resampler.resampled else "")
        return f"{read}, smaller than --image-size {','.join(map(str, self.size))}; use --image-size {fit}"

    def target(self, box: VolumeBox | None) -> VolumeBox:
        """``box`` of the patch (default: all of it) in voxels of the volume as read."""
        box = check_volume_box(box, self.size)
        offsets = [(e - s) // 2 for e, s in zip(self.extent, self.size, strict=True)]
        return tuple((o + a, o + b) for o, (a, b) in zip(offsets, box, strict=True))

    def source(self, path: Path, box: VolumeBox, orientation: Orientation | None = None) -> np.ndarray:
        """``(C, d, h, w)`` voxels of ``box`` of the file at ``path`` read in ``orientation`` (default: its own),
        zeros past its edges."""
        shape = self.info.shape
        inside = tuple((max(a, 0), min(b, n)) for (a, b), n in zip(box, shape, strict=True))
        data = read_volume(path, (slice(*inside[0]), slice(*inside[1]), slice(*inside[2])), orientation)
        if inside == box:
            return data
        out = np.zeros((data.shape[0], *(b - a for a, b in box)), dtype=data.dtype)
        out[(slice(None), *(slice(a - o, b - o) for (a, b), (o, _) in zip(inside, box, strict=True)))] = data
        return out

    def voxels(self, box: VolumeBox | None) -> np.ndarray:
        """float64 ``(C, d, h, w)`` of ``box`` of the patch, as stored (before scaling to [0, 1])."""
        return self.resampler.read(lambda b: self.source(self.info.path, b), self.target(box))

    def labels(self, mask: Path, orientation: Orientation, box: VolumeBox | None) -> np.ndarray:
        """int64 ``(d, h, w)`` of ``box`` of the label patch of ``mask`` read in ``orientation`` (the image's
        geometry)."""
        return self.resampler.vote(lambda b: self.source(mask, b, orientation), self.target(box))


def check_volume_box(box: VolumeBox | None, size: VolumeSize) -> VolumeBox:
    """``box`` (default: all) checked to lie inside a ``size`` patch."""
    if box is None:
        return (0, size[0]), (0, size[1]), (0, size[2])
    if len(box) != 3 or not all(0 <= a < b <= n for (a, b), n in zip(box, size, strict=True)):
        raise ValueError(f"region {box} ((d0, d1), (r0, r1), (c0, c1)) is not inside a {volume_size_text(size)} "
                         f"patch")
    return tuple((int(a), int(b)) for a, b in box)


def intensity_scale(dtype: np.dtype) -> float:
    """What an image volume's voxels are divided by: its integer type's maximum, 1 for floats."""
    return float(np.iinfo(dtype).max) if np.issubdtype(dtype, np.integer) else 1.0


def volume_problem(image: Path, size: VolumeSize, voxel_size: VoxelSize | None = None) -> str | None:
    """Why ``image`` gives no ``size`` patch (not a volume, or smaller than it at ``voxel_size``); None: it does."""
    try:
        return VolumePatch.of(volume_info(image), size, voxel_size).problem()
    except (ConfigError, ValueError) as err:
        return str(err).replace(f"{image}: ", "")


def volume_patches(files: Sequence[Path], size: VolumeSize, voxel_size: VoxelSize | None,
                   where: Path) -> tuple[list[VolumePatch], int]:
    """The ``size`` patch of each of ``files`` and their one channel count; ConfigError when they differ."""
    patches = [VolumePatch.of(volume_info(p), size, voxel_size) for p in files]
    channels = {patch.info.channels for patch in patches}
    if len(channels) > 1:
        raise ConfigError("--datapath", f"the volumes of {where} have {sorted(channels)} channels; keep one channel "
                                        f"count")
    return patches, channels.pop()


def read_patch(patch: VolumePatch, box: AnyBox | None) -> torch.Tensor:
    """``patch`` ``(C, d, h, w)`` float in [0, 1] (integer voxels), only ``box`` of it."""
    voxels = patch.voxels(volume_box(box)) / intensity_scale(patch.info.dtype)
    return torch.from_numpy(np.ascontiguousarray(voxels)).float()


def check_volume_pair(image: Path, size: VolumeSize, num_classes: int, ignore_index: int | None,
                      voxel_size: VoxelSize | None = None) -> str | None:
    """Why ``image`` and its label volume cannot be trained on (None: usable); reads the label volume slab by slab."""
    problem = volume_problem(image, size, voxel_size)
    if problem is not None:
        return problem
    try:
        info = volume_info(image)
        mask = label_volume_of(image)
        labels = volume_info(mask)
    except (ConfigError, ValueError) as err:
        return str(err).replace(f"{image}: ", "")
    if labels.channels == 1 and labels.scaling is not None:
        slope, inter = labels.scaling
        return (f"label volume {MASKS}/{mask.name} has scl_slope {slope:g} and scl_inter {inter:g} in its header, "
                f"which scale its stored values (to {labels.dtype}); a label volume holds one class index per voxel "
                f"as stored: set scl_slope 1 and scl_inter 0 (or both 0)")
    if labels.channels != 1 or not np.issubdtype(labels.dtype, np.integer):
        return (f"label volume {MASKS}/{mask.name} holds {labels.channels} channel(s) of {labels.dtype}; a label "
                f"volume holds one class index (integer) per voxel")
    orientation = paired_orientation(info.orientation, labels.orientation)
    shape = labels.shape_as(orientation)
    if shape != info.shape:
        return (f"label volume {MASKS}/{mask.name} is {volume_size_text(shape)} voxels (DxHxW) but its image "
                f"is {volume_size_text(info.shape)}; a label volume must match its image in size")
    found: set[int] = set()
    for start in range(0, shape[0], CHECK_SLAB):
        slab = read_volume(mask, (slice(start, start + CHECK_SLAB), slice(None), slice(None)), orientation)
        found.update(int(v) for v in np.unique(slab))
    return label_range_problem(found, num_classes, ignore_index, f"label volume {MASKS}/{mask.name}")


class VolumeFolderDataset:
    """``root/images/*`` volumes with ``root/masks/<same stem>`` label volumes: a centre patch of ``image_size``
    ``(D, H, W)`` voxels of each, at ``voxel_size`` µm ``(z, y, x)`` when given; any box read alone.

    ``files`` (default: every image) gives the volumes to use (the check's usable ones); each has label 0.
    ``image_size`` is the patch's largest side (the RegionDataset field), ``volume_size`` the patch;
    ``orientation_note`` what reading in RAS axes changed (None: nothing), for the run to say once.
    """

    def __init__(self, root: str | Path, image_size: VolumeSize, num_classes: int, *,
                 files: Sequence[Path] | None = None, voxel_size: VoxelSize | None = None) -> None:
        self.root = require_path(root)
        self.files = sorted(files) if files is not None else volume_images(self.root)
        if not self.files:
            raise FileNotFoundError(f"--datapath {str(root)!r} holds no volumes in {IMAGES}/ (.tif, .tiff, .nii, "
                                    f".nii.gz)")
        self.patches, self.channels = volume_patches(self.files, image_size, voxel_size, self.root / IMAGES)
        self.masks = [label_volume_of(p) for p in self.files]
        mask_infos = [volume_info(m) for m in self.masks]
        self.mask_orientations = [paired_orientation(patch.info.orientation, info.orientation)
                                  for patch, info in zip(self.patches, mask_infos, strict=True)]
        self.orientation_note = reoriented_note([patch.info for patch in self.patches], mask_infos)
        self.volume_size = image_size
        self.image_size = max(image_size)
        self.num_classes = num_classes
        self.voxel_size = voxel_size

    def __len__(self) -> int:
        return len(self.files)

    def label(self, index: int) -> int:
        return 0

    def read(self, index: int, box: AnyBox | None = None) -> torch.Tensor:
        """Volume ``index``'s patch ``(C, d, h, w)`` float in [0, 1] (integer voxels), only ``box`` of it."""
        return read_patch(self.patches[index], box)

    def read_mask(self, index: int, box: AnyBox | None = None) -> torch.Tensor:
        """Label patch ``index``, int64 ``(d, h, w)``, only ``box`` of it."""
        return torch.from_numpy(self.patches[index].labels(self.masks[index], self.mask_orientations[index],
                                                           volume_box(box)))

    def subset(self, indices: Sequence[int]) -> VolumeFolderDataset:
        """The volumes ``indices`` (one side of a held-out split) as a dataset of their own."""
        return VolumeFolderDataset(self.root, self.volume_size, self.num_classes,
                                   files=[self.files[i] for i in indices], voxel_size=self.voxel_size)

    def groups(self) -> Groups:
        """What a held-out split keeps whole: each volume's patient (``patients.csv``), else the volume."""
        return volume_groups(self.root, self.files)


def volume_box(box: AnyBox | None) -> VolumeBox | None:
    """``box`` when it is a volume's (or None); ValueError for an image's 2-D box."""
    if box is None:
        return None
    if is_volume_box(box):
        return box
    raise ValueError(f"a volume is read by a 3-D box ((d0, d1), (r0, r1), (c0, c1)), got the 2-D box {box}")
