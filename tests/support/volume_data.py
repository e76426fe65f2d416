"""Volume test data: a folder of ``images/`` volumes with their ``masks/`` label volumes, as TIFF stacks and NIfTI."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np


def write_volume_pairs(root: Path, shape: tuple[int, int, int] = (10, 12, 14), classes: int = 3, seed: int = 0,
                       names: tuple[str, ...] = ("a", "b")) -> Path:
    """A volume per name, alternately an ImageJ TIFF stack of 1 x 0.5 x 0.5 µm voxels (z, y, x) and a NIfTI of the
    same voxel size in µm (stored x, y, z), each with a label volume of ``classes`` classes (the image brighter
    where the label is higher, so that a network can learn something)."""
    import nibabel
    import tifffile

    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for k, name in enumerate(names):
        labels = rng.integers(0, classes, shape, dtype=np.uint8)
        image = (rng.integers(0, 30000, shape) + labels.astype(np.int64) * 15000).astype(np.uint16)
        if k % 2 == 0:
            tifffile.imwrite(root / "images" / f"{name}.tif", image, imagej=True, resolution=(2.0, 2.0),
                             metadata={"spacing": 1.0, "unit": "um", "axes": "ZYX"})
            tifffile.imwrite(root / "masks" / f"{name}.tif", labels, photometric="minisblack")
        else:
            nifti = nibabel.Nifti1Image(image.transpose(2, 1, 0), np.diag([0.5, 0.5, 1.0, 1.0]))
            nifti.header.set_xyzt_units("micron")
            nibabel.save(nifti, root / "images" / f"{name}.nii.gz")
            nibabel.save(nibabel.Nifti1Image(labels.transpose(2, 1, 0), np.eye(4)), root / "masks" / f"{name}.nii.gz")
    return root


def write_volume_classes(root: Path, shape: tuple[int, int, int] = (8, 8, 8), seed: int = 0,
                         classes: dict[str, tuple[str, ...]] | None = None) -> Path:
    """A class folder per class of volumes, alternately ImageJ TIFF stacks and NIfTI of 1 x 0.5 x 0.5 µm voxels (z,
    y, x), the volumes of a later class brighter (so that a network can learn something); default two classes of two
    volumes each (``benign``: a, b; ``tumour``: c, d)."""
    import nibabel
    import tifffile

    rng = np.random.default_rng(seed)
    chosen = classes or {"benign": ("a", "b"), "tumour": ("c", "d")}
    k = 0
    for label, (name, volumes) in enumerate(chosen.items()):
        (root / name).mkdir(parents=True)
        for volume in volumes:
            image = (rng.integers(0, 30000, shape) + label * 20000).astype(np.uint16)
            if k % 2 == 0:
                tifffile.imwrite(root / name / f"{volume}.tif", image, imagej=True, resolution=(2.0, 2.0),
                                 metadata={"spacing": 1.0, "unit": "um", "axes": "ZYX"})
            else:
                nifti = nibabel.Nifti1Image(image.transpose(2, 1, 0), np.diag([0.5, 0.5, 1.0, 1.0]))
                nifti.header.set_xyzt_units("micron")
                nibabel.save(nifti, root / name / f"{volume}.nii.gz")
            k += 1
    return root


@contextmanager
def recorded_reads(shape: tuple[int, ...]) -> Iterator[list[tuple[str, tuple[tuple[int, int], ...]]]]:
    """Every region this process reads of a volume file while inside: (file name, (start, stop) per axis of a file
    of ``shape``); ``data.volume.dataset.read_volume`` as it was afterwards."""
    from mpi4dl_nb.data.volume import dataset as volume_dataset

    regions: list[tuple[str, tuple[tuple[int, int], ...]]] = []
    original = volume_dataset.read_volume

    def recording(path, region=None, orientation=None):
        regions.append((Path(path).name, tuple(part.indices(n)[:2] for part, n in zip(region, shape))))
        return original(path, region, orientation)

    volume_dataset.read_volume = recording
    try:
        yield regions
    finally:
        volume_dataset.read_volume = original
