"""The files of volume inference: a label volume and one float32 probability volume per class, filled piece by piece
(rank 0) through ``data/volume/writer.py``; a piece beyond the volume (its zero extension) is cut off. The outputs of a
NIfTI scan are written back into its grid and header (``ScanSpace``), so they overlay it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...config import ConfigError
from ...data.volume.space import ScanSpace
from ...data.volume.writer import VolumeFormat, VolumeWriter, VoxelSize, label_dtype, volume_format
from ..windows import Extent
from .kinds import check_folder

FLOAT32 = np.dtype(np.float32)
SUFFIXES = {VolumeFormat.TIFF: None, VolumeFormat.NIFTI: ".nii", VolumeFormat.NIFTI_GZ: ".nii.gz"}


def probability_path(labels: Path, index: int) -> Path:
    """Class ``index``'s probability volume beside ``labels``: ``NAME_prob<index>`` with the same ending."""
    fmt = volume_format(labels)
    suffix = SUFFIXES[fmt] or labels.suffix
    stem = labels.name[:-len(suffix)]
    return labels.with_name(f"{stem}_prob{index}{suffix}")


@dataclass(frozen=True)
class VolumeOutputs:
    """The label volume's path and each class' probability volume (none when ``probabilities`` is off), stored as
    ``probability_dtype`` (float32; float64 keeps a float64 run's values exactly, in NIfTI or a plain TIFF)."""

    labels: Path
    probabilities: tuple[Path, ...]
    probability_dtype: np.dtype = FLOAT32

    @classmethod
    def beside(cls, labels: Path | str, classes: int, probabilities: bool = True,
               probability_dtype: np.dtype = FLOAT32) -> VolumeOutputs:
        labels = Path(labels)
        volume_format(labels)
        paths = tuple(probability_path(labels, k) for k in range(classes)) if probabilities else ()
        return cls(labels, paths, np.dtype(probability_dtype))

    @property
    def paths(self) -> tuple[Path, ...]:
        return (self.labels, *self.probabilities)

    def check_free(self, overwrite: bool) -> None:
        """Refuse outputs whose folder cannot take them (a file in the way, not writable; a missing one is made) and
        outputs that exist already, unless ``overwrite``."""
        check_folder(self.labels, made=True)
        taken = [str(p) for p in self.paths if p.exists()]
        if taken and not overwrite:
            raise ConfigError("--output", f"{', '.join(taken)} exist(s); choose another name or pass --overwrite")


class VolumeSink:
    """Rank 0: the output volumes of a ``(D, H, W)`` volume (output cells), written piece by piece; ``space``: the
    scan's grid and header at the output's stride (None: not a NIfTI scan)."""

    def __init__(self, outputs: VolumeOutputs, shape: tuple[int, int, int], classes: int,
                 voxel_size: VoxelSize | None, space: ScanSpace | None = None) -> None:
        self.shape = shape
        self.labels = VolumeWriter(outputs.labels, shape, label_dtype(classes), voxel_size, space)
        self.probabilities = [VolumeWriter(p, shape, outputs.probability_dtype, voxel_size, space)
                              for p in outputs.probabilities]

    def write(self, extent: Extent, probabilities: np.ndarray) -> None:
        """Class probabilities ``(K, d, h, w)`` of the cells ``extent``; the part beyond the volume is dropped."""
        inside = tuple((a, min(b, n)) for (a, b), n in zip(extent, self.shape))
        if any(b <= a for a, b in inside):
            return
        values = probabilities[(slice(None), *(slice(0, b - a) for a, b in inside))]
        region = (inside[0], inside[1], inside[2])
        self.labels.write(region, values.argmax(axis=0).astype(self.labels.dtype))
        for writer, plane in zip(self.probabilities, values):
            writer.write(region, plane.astype(writer.dtype))

    def close(self) -> None:
        for writer in (self.labels, *self.probabilities):
            writer.close()
