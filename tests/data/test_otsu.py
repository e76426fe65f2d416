"""``--tissue otsu``: Otsu's threshold equals a direct search of every split; it separates two populations exactly
and finds pale tissue the fixed saturation threshold misses, on a slide's overview (training tiles and infer's
``--tissue-only`` map alike)."""

import numpy as np
import pytest

from mpi4dl_nb.data.otsu import otsu_level
from mpi4dl_nb.data.pathology import SlideDataset
from mpi4dl_nb.data.tissue_mask import SATURATION_TISSUE, TissueMethod, saturation, tissue_mask
from mpi4dl_nb.infer.tissue import TissueMap
from tests.support.pyramid import write_pyramid

GLASS = (246, 246, 246)
PALE = (236, 224, 233)            # saturation 12/236 = 0.051: stained, below the fixed 0.07


def brute_force(values):
    """The split ``<= k | > k`` of the largest between-class variance, every k tried on the values themselves."""
    flat = values.ravel().astype(np.float64)
    best, level = -1.0, None
    for k in range(255):
        low, high = flat[flat <= k], flat[flat > k]
        if len(low) and len(high):
            between = len(low) * len(high) * (low.sum() / len(low) - high.sum() / len(high)) ** 2
            if between > best:
                best, level = between, k
    return level


@pytest.mark.parametrize("seed", range(4))
def test_otsu_equals_the_direct_search_of_every_split(seed):
    rng = np.random.default_rng(seed)
    values = np.concatenate([rng.normal(40 + 10 * seed, 12, 3000), rng.normal(170, 30, 1000 * (seed + 1)),
                             rng.integers(0, 256, 50)])
    values = np.clip(np.rint(values), 0, 255).astype(np.uint8)
    assert otsu_level(values) == brute_force(values)
    sparse = rng.choice(np.array([3, 9, 120, 121, 250], np.uint8), size=500)     # empty levels tie: the lowest
    assert otsu_level(sparse) == brute_force(sparse)


def test_otsu_splits_two_separated_populations_at_the_top_of_the_lower():
    rng = np.random.default_rng(0)
    low, high = rng.integers(0, 41, 5000), rng.integers(150, 256, 700)
    values = rng.permutation(np.concatenate([low, high])).astype(np.uint8)
    assert otsu_level(values) == 40 == low.max()
    assert otsu_level(np.full(10, 7, np.uint8)) == 7             # one level: nothing above it
    with pytest.raises(ValueError, match="levels 0..255"):
        otsu_level(np.array([3, 300]))


def pale_tissue(side=256):
    """An RGB image: glass, a pale stained region on its left half, a near-black corner (void, never tissue)."""
    rng = np.random.default_rng(1)
    image = np.empty((side, side, 3), np.uint8)
    image[:] = GLASS
    image[:, : side // 2] = PALE
    image = np.clip(image.astype(np.int64) + rng.integers(-1, 2, image.shape), 0, 255).astype(np.uint8)
    image[:8, -8:] = (10, 0, 5)
    return image


def test_otsu_finds_pale_tissue_the_fixed_threshold_misses():
    image = pale_tissue()
    truth = np.zeros(image.shape[:2], bool)
    truth[:, :128] = True
    assert saturation(image)[truth].max() < SATURATION_TISSUE
    assert not tissue_mask(image, TissueMethod.SATURATION)[truth].any()
    assert np.array_equal(tissue_mask(image, TissueMethod.OTSU), truth)
    otsu = TissueMap.from_overview(image, 1024, 1024, TissueMethod.OTSU)            # infer --tissue-only's map
    assert otsu.fraction((0, 1024, 0, 512)) == 1.0 and otsu.fraction((0, 1024, 512, 1024)) == 0.0
    assert TissueMap.from_overview(image, 1024, 1024).fraction((0, 1024, 0, 512)) == 0.0


def test_slide_tiles_keep_the_tissue_otsu_finds_on_the_overview(tmp_path):
    path = tmp_path / "pale.tif"
    write_pyramid(path, pale_tissue(), levels=3, tile=64)
    otsu = SlideDataset([path], 64, min_tissue=0.5, tissue=TissueMethod.OTSU)
    assert sorted({tile.x for tile in otsu.tiles}) == [0, 64] and len(otsu) == 8
    with pytest.raises(ValueError, match="no 64px tile at level 0 has 50% tissue"):
        SlideDataset([path], 64, min_tissue=0.5)                                  # the fixed threshold: none
