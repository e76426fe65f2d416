"""Class folders of volumes (``<root>/<class>/<name>.tif|.nii|.nii.gz``): a centre patch of each, labelled by folder.

The classes are the folders' names, sorted (or in the order of ``--classes``), found as 2-D class folders are
(``data.files.class_of``: an empty class folder refused). Each volume gives its centre ``--image-size D,H,W`` patch at
``--voxel-size`` (``volume/dataset.VolumePatch``); ``read(index, box)`` reads only the box (a spatial rank's tile).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ...errors import ConfigError
from ..dataset import AnyBox
from ..files import class_of, require_path
from ..groups import Groups
from ..validate import excluded
from .dataset import VolumeSize, read_patch, volume_patches
from .files import volume_stem
from .groups import PATIENTS_FILE, volume_groups
from .reoriented import reoriented_note
from .resample import VoxelSize


def class_volume_files(root: Path) -> list[Path]:
    """Every file below ``root`` (sorted, hidden ones and ``patients.csv`` left out): volumes, and anything else the
    data check then names."""
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")
                  and p.relative_to(root).parts[0] != PATIENTS_FILE)


def volume_class_labels(root: Path, files: Sequence[Path],
                        order: Sequence[str] | None = None) -> tuple[list[int], list[str]]:
    """(the class of each of ``files``, the class names): their class folders below ``root`` (``order``: the names
    in label order); ConfigError naming ``--datapath`` for files outside class folders, two of one name (stem), an
    empty class folder."""
    if not files:
        raise ConfigError("--datapath", f"{root} holds no volumes: give a folder of class folders of volume files "
                                        f"(<class>/<name>.tif, .nii, .nii.gz)")
    loose = [p.name for p in files if len(p.relative_to(root).parts) == 1]
    if loose:
        raise ConfigError("--datapath", f"{root} holds {', '.join(loose[:3])} outside a class folder; volumes to "
                                        f"classify sit in the folder of their class (<class>/<name>.tif)")
    seen: dict[str, Path] = {}
    for path in files:
        other = seen.setdefault(volume_stem(path), path)
        if other != path:
            raise ConfigError("--datapath", f"{other.relative_to(root)} and {path.relative_to(root)} share the name "
                                            f"{volume_stem(path)!r}; a split and {PATIENTS_FILE} name volumes by "
                                            f"file name: rename one")
    try:
        return class_of(files, root, order)
    except ValueError as err:
        raise ConfigError("--datapath", str(err)) from None


def volume_classes(datapath: str | Path) -> tuple[str, ...]:
    """The class names of a folder of class folders of volumes, sorted (``--classes`` may reorder them)."""
    root = require_path(datapath)
    return tuple(volume_class_labels(root, class_volume_files(root))[1])


class VolumeClassDataset:
    """Volumes ``files`` (below ``root``) of the classes ``class_names`` (``labels``: each one's): the centre patch of
    ``image_size`` ``(D, H, W)`` voxels of each, at ``voxel_size`` µm ``(z, y, x)`` when given; any box read alone.

    ``image_size`` is the patch's largest side (the RegionDataset field), ``volume_size`` the patch;
    ``orientation_note`` what reading NIfTI volumes in RAS axes changed (None: nothing), for the run to say once.
    """

    def __init__(self, root: Path, image_size: VolumeSize, files: Sequence[Path], labels: Sequence[int],
                 class_names: Sequence[str], voxel_size: VoxelSize | None = None) -> None:
        self.root = root
        self.files = list(files)
        self.labels = list(labels)
        self.class_names = tuple(class_names)
        self.patches, self.channels = volume_patches(self.files, image_size, voxel_size, root)
        self.orientation_note = reoriented_note([patch.info for patch in self.patches])
        self.volume_size = image_size
        self.image_size = max(image_size)
        self.num_classes = len(self.class_names)
        self.voxel_size = voxel_size

    @staticmethod
    def open(datapath: str | Path, image_size: VolumeSize, *, classes: Sequence[str] | None = None,
             exclude: Sequence[Path] = (), voxel_size: VoxelSize | None = None) -> VolumeClassDataset:
        """The class folders of volumes of ``datapath`` (without the files ``exclude``), labelled in the order of
        ``classes`` (default: sorted)."""
        root = require_path(datapath)
        files = excluded(class_volume_files(root), exclude)
        labels, names = volume_class_labels(root, files, classes)
        return VolumeClassDataset(root, image_size, files, labels, names, voxel_size)

    def __len__(self) -> int:
        return len(self.files)

    def label(self, index: int) -> int:
        return self.labels[index]

    def read(self, index: int, box: AnyBox | None = None) -> torch.Tensor:
        """Volume ``index``'s patch ``(C, d, h, w)`` float in [0, 1] (integer voxels), only ``box`` of it."""
        return read_patch(self.patches[index], box)

    def subset(self, indices: Sequence[int]) -> VolumeClassDataset:
        """The volumes ``indices`` (one side of a held-out split) as a dataset of their own, classes unchanged."""
        return VolumeClassDataset(self.root, self.volume_size, [self.files[i] for i in indices],
                                  [self.labels[i] for i in indices], self.class_names, self.voxel_size)

    def groups(self) -> Groups:
        """What a held-out split keeps whole: each volume's patient (``patients.csv``), else the volume."""
        return volume_groups(self.root, self.files)
