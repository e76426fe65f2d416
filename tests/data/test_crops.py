"""Tile folders, mask folders and annotated slides at ``--mpp``: each image shrunk from its own MPP, masks by
majority label, any box read alone equal to the whole crop; the MPP read at recorded; images without MPP, too
small or too coarse refused before work, naming the file and the flag."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.data.annotated_slides import AnnotatedSlideDataset
from mpi4dl_nb.data.crops import CentreCrop, folder_mpp
from mpi4dl_nb.data.masks import MaskFolderDataset
from mpi4dl_nb.data.pathology import TileFolderDataset
from mpi4dl_nb.data.rasterize import label_map
from mpi4dl_nb.data.resolution import AreaResampler, LevelChoice
from tests.support.pyramid import write_pyramid
from tests.support.segmentation_data import write_pairs

BOX = (5, 29, 17, 40)


def dpi(mpp: float) -> tuple[float, float]:
    return (25400 / mpp, 25400 / mpp)


def tagged_tiles(root, mpp=0.5, size=80, count=2):
    """``count`` RGB tiles of ``size`` px in two class folders, tagged at ``mpp`` µm/px (None: untagged)."""
    rng = np.random.default_rng(0)
    for k in range(count):
        folder = root / f"class{k % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        image = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
        image.save(folder / f"t{k}.png", **({} if mpp is None else {"dpi": dpi(mpp)}))
    return root


def test_a_tile_folder_at_mpp_is_each_tile_shrunk_then_cropped_any_box_alone_the_same(tmp_path):
    root = tagged_tiles(tmp_path / "tiles", size=90)
    native = TileFolderDataset(root, 64)
    assert native.mpp == pytest.approx(0.5) and native.choices is None        # recorded from the tags
    data = TileFolderDataset(root, 64, mpp=0.625)                            # 90 px shrink to 72, crop 64
    assert data.mpp == 0.625 and [c.scale for c in data.choices] == [pytest.approx(1.25)] * 2
    whole = data.read(1)
    assert torch.equal(data.read(1, BOX), whole[:, BOX[0]:BOX[1], BOX[2]:BOX[3]])   # a rank's tile, bitwise
    pixels = np.asarray(Image.open(sorted(root.rglob("*.png"))[1]).convert("RGB"))
    shrunk = AreaResampler(1.25).read(lambda b: np.pad(pixels, ((0, 8), (0, 8), (0, 0)))[b[0]:b[1], b[2]:b[3]],
                                      (0, 72, 0, 72))
    assert torch.equal(whole, torch.from_numpy(shrunk[4:68, 4:68].transpose(2, 0, 1).copy()).float() / 255)
    assert TileFolderDataset(root, 64, mpp=0.505).choices[0].scale == 1.0    # within 2 %: as it is


def test_tiles_without_mpp_too_small_or_too_coarse_are_refused_naming_file_and_flag(tmp_path):
    untagged = tagged_tiles(tmp_path / "plain", mpp=None)
    with pytest.raises(ConfigError, match=r"t0.png carries no resolution .*pass --source-mpp") as err:
        TileFolderDataset(untagged, 64, mpp=1.0)
    assert err.value.knob == "--source-mpp"
    assert TileFolderDataset(untagged, 32, mpp=1.0, source_mpp=0.5).mpp == 1.0
    assert TileFolderDataset(untagged, 32, source_mpp=0.5).mpp == 0.5 and folder_mpp(untagged.rglob("*.png")) is None
    tagged = tagged_tiles(tmp_path / "tagged")
    with pytest.raises(ValueError, match=r"t0.png is 80x80, 40x40 at 1 µm/px: smaller than --image-size 64; use "
                                         r"--image-size <= 40 or a finer --mpp"):
        TileFolderDataset(tagged, 64, mpp=1.0)
    with pytest.raises(ConfigError, match="would invent detail: use --mpp >= 0.5"):
        TileFolderDataset(tagged, 64, mpp=0.25)


def test_masks_at_mpp_take_the_majority_label_of_their_images_footprint(tmp_path):
    root = write_pairs(tmp_path / "pairs", count=2, size=96)
    for path in (root / "images").iterdir():
        Image.open(path).save(path, dpi=dpi(0.5))
    data = MaskFolderDataset(root, 64, 3, mpp=0.75)                       # 96 px shrink to 64
    assert data.mpp == 0.75
    mask = data.read_mask(0)
    assert mask.dtype == torch.int64 and set(mask.unique().tolist()) <= {0, 1, 2}
    assert torch.equal(data.read_mask(0, BOX), mask[BOX[0]:BOX[1], BOX[2]:BOX[3]])
    labels = np.asarray(Image.open(root / "masks" / "tile0.png"))
    expected = AreaResampler(1.5).vote(lambda b: np.pad(labels, 4)[4 + b[0]:4 + b[1], 4 + b[2]:4 + b[3]],
                                       (0, 64, 0, 64))
    assert np.array_equal(mask.numpy(), expected)
    assert torch.equal(MaskFolderDataset(root, 64, 3).read_mask(0), torch.from_numpy(labels[16:80, 16:80].astype(
        np.int64)))                                                          # without --mpp: the crop as it is


def test_annotated_slides_at_mpp_rasterise_at_that_resolution(tmp_path):
    image = np.random.default_rng(0).integers(60, 200, (256, 256, 3), dtype=np.uint8)
    write_pyramid(tmp_path / "s.tif", image, levels=2, tile=64)
    ring = [[20.0, 30.0], [200.0, 40.0], [180.0, 220.0], [40.0, 190.0], [20.0, 30.0]]
    (tmp_path / "s.geojson").write_text(json.dumps({"type": "FeatureCollection", "features": [
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [ring]},
         "properties": {"classification": {"name": "tumor"}}}]}))
    data = AnnotatedSlideDataset([tmp_path / "s.tif"], 32, ["background", "tumor"], min_tissue=0, mpp=0.6,
                                 source_mpp=0.25)                           # level 1 (0.5), then shrunk 1.2x
    assert data.mpp == 0.6 and data.slides.choices[0].level == 1
    tile = data.slides.tiles[3]
    mask = data.read_mask(3)
    pixel = 0.6 / 0.25                                                     # level-0 pixels per pixel read
    expected = label_map([[], [[np.array(ring)]]], (tile.y, tile.y + 32, tile.x, tile.x + 32), pixel)
    assert np.array_equal(mask.numpy(), expected) and mask.unique().tolist() == [0, 1]
    r0, r1, c0, c1 = box = (5, 29, 7, 30)                                 # inside the 32 px tile
    assert torch.equal(data.read_mask(3, box), mask[r0:r1, c0:c1])


def test_centre_crop_geometry():
    crop = CentreCrop(90, 70, 32, LevelChoice(0, 2.0, 1.0))
    assert crop.extent == (45, 35) and crop.target(None) == (1, 33, 6, 38) and crop.problem() is None
    assert CentreCrop(30, 70, 32).problem() == "is 30x70, smaller than --image-size 32; use --image-size <= 30"
