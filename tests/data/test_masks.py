"""Image/mask folders: pairs by stem, masks cropped and boxed like their images, every bad pair named; the IHC
stand-in mask; masks of a batch turned with their augmented images."""

import numpy as np
import pytest
import torch
from PIL import Image

from mpi4dl_nb.data import Batcher
from mpi4dl_nb.data.augment import AugmentSpec
from mpi4dl_nb.data.masks import (
    MaskDataset,
    MaskFolderDataset,
    batch_masks,
    check_pair,
    is_mask_folder,
    label_range_problem,
)
from mpi4dl_nb.data.sample import IHCMaskDataset, dab_mask, ihc_image


def make_folder(root, count=3, size=40, classes=3, seed=0, mask_ext=".png"):
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for k in range(count):
        Image.fromarray(rng.integers(0, 255, (size, size + 4, 3), dtype=np.uint8)).save(root / "images" / f"t{k}.png")
        mask = rng.integers(0, classes, (size, size + 4), dtype=np.uint8)
        Image.fromarray(mask).save(root / "masks" / f"t{k}{mask_ext}")
    return root


def test_a_folder_of_pairs_reads_images_and_masks_alike(tmp_path):
    root = make_folder(tmp_path / "d", mask_ext=".tif")
    assert is_mask_folder(root) and not is_mask_folder(tmp_path)
    data = MaskFolderDataset(root, 32, num_classes=3)
    assert isinstance(data, MaskDataset) and len(data) == 3 and data.label(1) == 0
    whole = np.asarray(Image.open(root / "masks" / "t1.tif")).astype(np.int64)
    mask = data.read_mask(1)
    assert mask.dtype == torch.int64 and torch.equal(mask, torch.from_numpy(whole[4:36, 6:38]))   # centre crop
    assert torch.equal(data.read_mask(1, (3, 20, 5, 31)), mask[3:20, 5:31])
    assert data.read(1, (3, 20, 5, 31)).shape == (3, 17, 26)


def test_check_pair_names_each_problem(tmp_path):
    root = make_folder(tmp_path / "d", count=5)
    images = sorted((root / "images").iterdir())
    Image.fromarray(np.zeros((30, 44), np.uint8)).save(root / "masks" / "t0.png")             # wrong size
    Image.fromarray(np.full((40, 44), 7, np.uint8)).save(root / "masks" / "t1.png")           # label 7
    Image.fromarray(np.zeros((40, 44, 3), np.uint8)).save(root / "masks" / "t2.png")          # RGB
    (root / "masks" / "t3.png").unlink()                                                       # none
    assert "mask masks/t0.png is 44x30 pixels but its image is 44x40" in check_pair(images[0], 32, 3, None)
    assert "holds label(s) 7 outside 0..2 (--num-classes 3, no --ignore-index)" in check_pair(images[1], 32, 3, None)
    assert check_pair(images[1], 32, 8, None) is None and check_pair(images[1], 32, 3, 7) is None
    assert "has pixel mode RGB" in check_pair(images[2], 32, 3, None)
    assert "no mask masks/t3{.png,.tif,.tiff} for images/t3.png" in check_pair(images[3], 32, 3, None)
    assert check_pair(images[4], 32, 3, None) is None
    assert "smaller than --image-size 64" in check_pair(images[4], 64, 3, None)


def test_label_range_problem_names_the_labels_outside_the_classes():
    """The one label-range check of masks and label volumes: sorted, distinct, the first 6 shown."""
    assert label_range_problem(np.array([0, 1, 2, 255]), 3, 255, "mask masks/a.png") is None
    assert label_range_problem([], 3, None, "mask masks/a.png") is None
    assert label_range_problem([9, -1, 9, 0], 3, 255, "label volume masks/b.tif") == (
        "label volume masks/b.tif holds label(s) -1, 9 outside 0..2 (--num-classes 3, --ignore-index 255)")
    assert label_range_problem(range(20), 3, None, "mask masks/a.png") == (
        "mask masks/a.png holds label(s) 3, 4, 5, 6, 7, 8, ... outside 0..2 (--num-classes 3, no --ignore-index)")


def test_dab_mask_and_the_ihc_mask_dataset():
    mask = dab_mask(ihc_image())
    assert mask.shape == (512, 512) and mask.dtype == np.uint8 and 0.2 < mask.mean() < 0.8
    assert dab_mask(ihc_image(), threshold=10.0).sum() == 0
    data = IHCMaskDataset(128)
    assert data.num_classes == 2 and isinstance(data, MaskDataset)
    assert torch.equal(data.read_mask(13, (3, 60, 4, 90)), data.read_mask(13)[3:60, 4:90])
    assert set(torch.unique(data.read_mask(0)).tolist()) <= {0, 1}


def test_batch_masks_turn_with_their_augmented_images(tmp_path):
    data = MaskFolderDataset(make_folder(tmp_path / "d", count=4), 32, num_classes=3)
    batcher = Batcher(data, 4, seed=3, augment=AugmentSpec.parse("flip,rot90,color"))
    whole = batch_masks(batcher, 0, 0)
    box = (5, 21, 9, 30)
    assert torch.equal(batch_masks(batcher, 0, 0, box, rows=[1, 2]), whole[1:3, 5:21, 9:30])
    draws = [batcher.augmentation(0, 0, i) for i in batcher.indices(0, 0)]
    assert any(d.hflip or d.vflip or d.turns for d in draws)
    for k, (index, draw) in enumerate(zip(batcher.indices(0, 0), draws)):
        assert torch.equal(whole[k], draw.place(data.read_mask(index)))
    with pytest.raises(TypeError, match="has no masks"):
        batch_masks(Batcher(data.images, 2), 0, 0)
