"""Volume folders: centre patches of images and label volumes, any 3-D box read alone equal to that box of the whole
(at a voxel size too); every bad pair named before the first step."""

import numpy as np
import pytest
import torch

from mpi4dl_nb.data.volume.dataset import VolumeFolderDataset, check_volume_pair, label_volumes
from mpi4dl_nb.data.volume.resample import VolumeResampler, voxel_scales
from mpi4dl_nb.errors import ConfigError
from tests.support.requirements import VOLUMES_EXTRA, required_module
from tests.support.volume_data import write_volume_pairs

nibabel = required_module("nibabel", "volume dataset tests", VOLUMES_EXTRA)
tifffile = required_module("tifffile", "volume dataset tests", VOLUMES_EXTRA)

BOX = ((1, 5), (2, 7), (0, 3))


def test_patches_and_boxes_of_a_volume_folder(tmp_path):
    root = write_volume_pairs(tmp_path / "v")
    data = VolumeFolderDataset(root, (6, 8, 8), num_classes=3)
    assert len(data) == 2 and data.channels == 1 and data.label(1) == 0
    stored = tifffile.imread(root / "images" / "a.tif").astype(np.float64) / 65535
    whole = data.read(0)
    assert whole.shape == (1, 6, 8, 8) and torch.equal(whole, torch.from_numpy(stored[2:8, 2:10, 3:11]).float()[None])
    labels = tifffile.imread(root / "masks" / "a.tif").astype(np.int64)
    assert torch.equal(data.read_mask(0), torch.from_numpy(labels[2:8, 2:10, 3:11]))
    for index in (0, 1):
        cut = tuple(slice(a, b) for a, b in BOX)
        assert torch.equal(data.read(index, BOX), data.read(index)[(slice(None), *cut)])
        assert torch.equal(data.read_mask(index, BOX), data.read_mask(index)[cut])


def test_a_voxel_size_shrinks_each_axis_and_tiles_stay_bitwise(tmp_path):
    root = write_volume_pairs(tmp_path / "v", shape=(8, 16, 16))
    data = VolumeFolderDataset(root, (4, 6, 6), num_classes=3, voxel_size=(2.0, 1.5, 1.5))
    assert data.patches[0].resampler.scales == (2.0, 3.0, 3.0) and data.patches[0].extent == (4, 5, 5)
    assert "4x5x5 at --voxel-size, smaller than --image-size 4,6,6; use --image-size 4,5,5" in data.patches[0].problem()
    data = VolumeFolderDataset(root, (4, 5, 5), num_classes=3, voxel_size=(2.0, 1.5, 1.5))
    box = ((1, 3), (2, 5), (0, 4))
    cut = tuple(slice(a, b) for a, b in box)
    for index in (0, 1):
        assert torch.equal(data.read(index, box), data.read(index)[(slice(None), *cut)])
        assert torch.equal(data.read_mask(index, box), data.read_mask(index)[cut])
    # the mean of each 2x3x3 footprint (scale 2 along z, 3 along y and x), and the majority label
    stored = tifffile.imread(root / "images" / "a.tif").astype(np.float64)
    expected = stored[:8, :15, :15].reshape(4, 2, 5, 3, 5, 3).mean(axis=(1, 3, 5)) / 65535
    assert np.allclose(data.read(0)[0].numpy(), expected, atol=1e-6)
    labels = np.zeros((5, 10, 10), np.uint8)    # the source box of the taps
    labels[:, :3, :] = 2
    votes = VolumeResampler((2.0, 3.0, 3.0)).vote(lambda b: labels[None], ((0, 1), (0, 2), (0, 2)))
    assert votes.tolist() == [[[2, 2], [0, 0]]]


def test_voxel_scales_refuse_finer_or_unknown_sizes():
    assert voxel_scales((1.0, 0.5, 0.5), None, "v") == (1.0, 1.0, 1.0)
    assert voxel_scales((1.0, 0.5, 0.5), (1.0, 1.0, 2.0), "v") == (1.0, 2.0, 4.0)
    with pytest.raises(ConfigError, match="v has 1 µm voxels along z; 0.5 µm would invent detail"):
        voxel_scales((1.0, 0.5, 0.5), (0.5, 0.5, 0.5), "v")
    with pytest.raises(ConfigError, match="v does not say its voxel size"):
        voxel_scales(None, (1.0, 1.0, 1.0), "v")


def test_check_volume_pair_names_each_problem(tmp_path):
    root = write_volume_pairs(tmp_path / "v")
    size = (6, 8, 8)
    image_a, image_b = root / "images" / "a.tif", root / "images" / "b.nii.gz"
    assert check_volume_pair(image_a, size, 3, None) is None and check_volume_pair(image_b, size, 3, None) is None
    tifffile.imwrite(root / "masks" / "a.tif", np.zeros((10, 12, 13), np.uint8), photometric="minisblack")
    assert ("label volume masks/a.tif is 10x12x13 voxels (DxHxW) but its image is 10x12x14"
            in check_volume_pair(image_a, size, 3, None))
    bad = np.zeros((14, 12, 10), np.int16)
    bad[3, 4, 5] = 7
    nibabel.save(nibabel.Nifti1Image(bad, np.eye(4)), root / "masks" / "b.nii.gz")
    assert ("label volume masks/b.nii.gz holds label(s) 7 outside 0..2 (--num-classes 3, no --ignore-index)"
            in check_volume_pair(image_b, size, 3, None))
    assert check_volume_pair(image_b, size, 8, None) is None and check_volume_pair(image_b, size, 3, 7) is None
    assert "smaller than --image-size 6,8,16" in check_volume_pair(image_b, (6, 8, 16), 3, None)
    tifffile.imwrite(root / "images" / "flat.tif", np.zeros((12, 14), np.uint8))
    assert "not a volume" in check_volume_pair(root / "images" / "flat.tif", size, 3, None)
    tifffile.imwrite(root / "images" / "c.tif", np.zeros((10, 12, 14), np.uint8), photometric="minisblack")
    assert "no label volume masks/c.{tif,tiff,nii,nii.gz} for images/c.tif" in check_volume_pair(
        root / "images" / "c.tif", size, 3, None)
    tifffile.imwrite(root / "masks" / "c.tif", np.zeros((10, 12, 14), np.float32), photometric="minisblack")
    label_volumes.cache_clear()                       # the masks are listed once per folder
    assert "holds 1 channel(s) of float32" in check_volume_pair(root / "images" / "c.tif", size, 3, None)
