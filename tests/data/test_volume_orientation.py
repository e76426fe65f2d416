"""NIfTI orientation on reading: every stated grid read in RAS axes exactly (nibabel's closest canonical), a region
alone as that region of the whole; a label volume placed by its own affine against its image's (or voxel for voxel
when either states no axes); what reading changed said in one note; a collapsed affine refused naming the file."""

import numpy as np
import pytest
import torch

from mpi4dl_nb.data.volume.classes import VolumeClassDataset
from mpi4dl_nb.data.volume.dataset import VolumeFolderDataset, check_volume_pair
from mpi4dl_nb.data.volume.files import read_volume, volume_info
from mpi4dl_nb.data.volume.reoriented import reoriented_note
from mpi4dl_nb.errors import ConfigError
from tests.support.requirements import VOLUMES_EXTRA, required_module

nibabel = required_module("nibabel", "volume orientation tests", VOLUMES_EXTRA)

SHAPE = (9, 7, 5)                                  # stored x, y, z: every side different, so a swap shows
REGION = (slice(1, 4), slice(2, 6), slice(0, 3))


def affine(columns, sizes=(0.8, 0.8, 2.5), origin=(-120.0, -95.0, 30.0)):
    """A 4x4 affine whose stored axes i, j, k run along ``columns`` (world directions) with voxels ``sizes`` mm."""
    out = np.eye(4)
    out[:3, :3] = np.asarray(columns, dtype=np.float64).T * np.asarray(sizes)
    out[:3, 3] = origin
    return out


def tilted(degrees):
    """A rotation about the world's x axis (a gantry tilt)."""
    t = np.radians(degrees)
    return np.array([[1, 0, 0], [0, np.cos(t), -np.sin(t)], [0, np.sin(t), np.cos(t)]])


LAS = affine([(-1, 0, 0), (0, 1, 0), (0, 0, 1)])
SWAPPED = affine([(0, -1, 0), (0, 0, 1), (-1, 0, 0)])                       # i: P, j: S, k: L
OBLIQUE = affine((tilted(12.0) @ np.array([(0, -1, 0), (1, 0, 0), (0, 0, 1)]).T).T)


def save(path, data, matrix, unit="mm"):
    image = nibabel.Nifti1Image(data, matrix)
    image.header.set_xyzt_units(unit)
    path.parent.mkdir(parents=True, exist_ok=True)
    nibabel.save(image, path)
    return path


def canonical(path):
    """The file as nibabel's closest canonical (RAS) reads it, as (D, H, W) = (z, y, x), with its zooms."""
    image = nibabel.as_closest_canonical(nibabel.load(str(path)))
    return np.asarray(image.dataobj).transpose(2, 1, 0), image.header.get_zooms()[:3]


@pytest.mark.parametrize("name, matrix, codes", [("las", LAS, "LAS"), ("swapped", SWAPPED, "PSL"),
                                                  ("oblique", OBLIQUE, "PRS")])
def test_a_stated_nifti_reads_in_ras_axes_exactly_whole_and_by_region(tmp_path, name, matrix, codes):
    data = np.arange(np.prod(SHAPE), dtype=np.int16).reshape(SHAPE)
    path = save(tmp_path / f"{name}.nii.gz", data, matrix)
    want, zooms = canonical(path)
    info = volume_info(path)
    assert info.orientation.codes == codes and info.orientation.oblique == (name == "oblique")
    assert info.shape == want.shape and info.voxel_size == pytest.approx(tuple(1e3 * z for z in zooms[::-1]))
    assert np.array_equal(read_volume(path)[0], want)
    assert np.array_equal(read_volume(path, REGION)[0], want[REGION])


def pair(root, name, image, image_affine, labels, labels_affine):
    save(root / "images" / f"{name}.nii.gz", image, image_affine)
    save(root / "masks" / f"{name}.nii.gz", labels, labels_affine)


def test_a_label_volume_is_placed_by_its_own_affine_or_voxel_for_voxel_with_its_image(tmp_path):
    """Issue 65: a label volume stored mirrored against its image (its affine says so) was paired voxel for voxel,
    its labels mirrored; now placed by its affine (exact) and said, naming both files and the axis."""
    rng = np.random.default_rng(0)
    image = rng.integers(0, 30000, SHAPE).astype(np.int16)
    labels = rng.integers(0, 3, SHAPE).astype(np.uint8)       # in the image's grid
    root = tmp_path / "v"
    ras = LAS.copy()
    ras[0, 0], ras[0, 3] = 0.8, LAS[0, 3] - 0.8 * (SHAPE[0] - 1)     # the same voxels, x stored the other way
    pair(root, "mirrored", image, LAS, labels[::-1].copy(), ras)
    pair(root, "swapped", image, LAS, labels.transpose(1, 2, 0).copy(),
         affine([(0, 1, 0), (0, 0, 1), (-1, 0, 0)], (0.8, 2.5, 0.8), LAS[:3, 3]))
    save(root / "images" / "plain.nii.gz", image, LAS)
    unstated = nibabel.Nifti1Image(labels, None)                 # no qform or sform: the image's grid
    nibabel.save(unstated, root / "masks" / "plain.nii.gz")
    data = VolumeFolderDataset(root, (5, 7, 9), num_classes=3)
    want = canonical(root / "images" / "plain.nii.gz")[0]
    aligned = np.asarray(nibabel.as_closest_canonical(nibabel.Nifti1Image(labels, LAS)).dataobj).transpose(2, 1, 0)
    for index, name in enumerate(data.files):
        assert check_volume_pair(name, (5, 7, 9), 3, None) is None
        assert np.array_equal(data.read(index)[0].numpy(), (want / 32767).astype(np.float32))
        assert torch.equal(data.read_mask(index), torch.from_numpy(aligned.astype(np.int64))), name
    note = data.orientation_note
    assert note is not None and "3 reoriented" in note and "images/plain.nii.gz (LAS)" in note
    assert "masks/mirrored.nii.gz (RAS) mirrored left-right against its image images/mirrored.nii.gz (LAS)" in note
    assert "masks/swapped.nii.gz (ASL) stored with its axes in another order against its image" in note
    assert "masks/plain.nii.gz" not in note                       # voxel for voxel, as before


def test_a_mixed_training_set_is_read_in_ras_axes_and_said_in_one_note(tmp_path):
    rng = np.random.default_rng(1)
    root = tmp_path / "classes"
    matrices = {"a": affine(np.eye(3)), "b": LAS, "c": OBLIQUE}
    for name, matrix in matrices.items():
        save(root / ("tumour" if name == "c" else "benign") / f"{name}.nii.gz",
             rng.integers(0, 30000, SHAPE).astype(np.int16), matrix)
    data = VolumeClassDataset.open(root, (5, 5, 5))
    note = data.orientation_note
    assert note is not None and note.startswith("volumes read in RAS axes"), note
    assert "1 reoriented: benign/b.nii.gz (LAS)" in note
    assert "1 oblique, read in their closest RAS axes and trained on their voxel grid as stored (not rotated): " \
           "tumour/c.nii.gz (PRS, oblique 12.0°)" in note
    assert "benign/a.nii.gz" not in note                          # stored RAS: nothing changed
    assert reoriented_note([volume_info(root / "benign" / "a.nii.gz")]) is None


def test_an_affine_that_collapses_an_axis_is_refused_naming_the_file(tmp_path):
    flat = LAS.copy()
    flat[:3, 1] = 0.0
    image = nibabel.Nifti1Image(np.zeros(SHAPE, np.int16), None)
    image.header.set_sform(flat, code=2)
    nibabel.save(image, tmp_path / "flat.nii")
    for read in (volume_info, read_volume):
        with pytest.raises(ConfigError, match="maps a voxel axis to no direction.*fix the header's qform/sform") as err:
            read(tmp_path / "flat.nii")
        assert str(tmp_path / "flat.nii") in str(err.value)
