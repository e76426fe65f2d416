"""Issue 91 items 2 and 4: a plain (not pyramidal) TIFF holding several ``--image-size`` tiles is a slide, read
through Pillow and tiled over its tissue as a pyramidal one is (its MPP from its resolution tags), also beside a
pyramidal one; one too large to read whole is refused naming "not pyramidal" and the conversion; a tile folder's
images larger than the crop are centre-cropped, said in one line."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mpi4dl_nb.data import pathology
from mpi4dl_nb.data.pathology import SlideDataset, TileFolderDataset, open_pathology
from mpi4dl_nb.data.validate import SourceKind, check_file, find_sources
from tests.support.pyramid import write_pyramid
from tests.support.train_in_process import run_train

SIDE = 1024            # the slides' side: 4 x 4 tiles of 256 px
TILE = 256
RUN = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4", "--image-size",
       str(TILE), "--batch-size", "2", "--steps", "1", "--split-size", "1", "--spatial-size", "0", "--no-progress",
       "--app", "medical"]


def tissue_image(left: int, seed: int) -> np.ndarray:
    """A white SIDE x SIDE image whose columns from ``left`` on (and rows 0..511) are stained tissue."""
    rng = np.random.default_rng(seed)
    image = np.full((SIDE, SIDE, 3), 245, np.uint8)
    stain = rng.integers(90, 170, (SIDE // 2, SIDE - left, 3), dtype=np.uint8)
    stain[..., 1] //= 2                                   # saturated: tissue to the saturation mask
    image[:SIDE // 2, left:] = stain
    return image


def write_plain(path: Path, image: np.ndarray, mpp: float = 0.5) -> Path:
    """``image`` as a plain (stripped, one page) TIFF with its resolution tags."""
    import tifffile

    path.parent.mkdir(parents=True, exist_ok=True)
    tifffile.imwrite(path, image, photometric="rgb", resolution=(1e4 / mpp, 1e4 / mpp), resolutionunit="CENTIMETER")
    return path


@pytest.fixture
def plain_slides(tmp_path: Path) -> Path:
    """Two plain 1024-px TIFF slides in class folders: tissue on the upper half, from column 0 and from 512."""
    for label, (name, left) in enumerate((("benign", 0), ("tumour", 512))):
        write_plain(tmp_path / "slides" / name / f"s{label}.tif", tissue_image(left, label))
    return tmp_path / "slides"


def test_plain_tiffs_are_slides_tiled_over_their_tissue(plain_slides):
    dataset = open_pathology(plain_slides, TILE)
    assert isinstance(dataset, SlideDataset) and dataset.mpp == 0.5           # its tags' MPP
    corners = {(dataset.paths[t.slide].stem, t.x, t.y) for t in dataset.tiles}
    assert corners == {("s0", x, 0) for x in range(0, SIDE, TILE)} | {("s0", x, TILE) for x in range(0, SIDE, TILE)} \
        | {("s1", x, y) for x in (512, 768) for y in (0, TILE)}               # the tissue's tiles, no other
    tile = next(i for i, t in enumerate(dataset.tiles) if dataset.paths[t.slide].stem == "s1")
    expected = tissue_image(512, 1)[:TILE, 512:512 + TILE].transpose(2, 0, 1) / 255.0
    np.testing.assert_allclose(dataset.read(tile).numpy(), expected, atol=1e-7)   # the slide's own pixels
    np.testing.assert_allclose(dataset.read(tile, (8, 40, 100, 200)).numpy(), expected[:, 8:40, 100:200], atol=1e-7)
    sources = find_sources("medical", plain_slides, image_size=TILE)
    assert sources.kind is SourceKind.SLIDES and all(check_file(p, SourceKind.SLIDES, TILE) is None
                                                     for p in sources.files)
    small = open_pathology(plain_slides, 600)                                 # one tile at most: a tile, cropped
    assert isinstance(small, TileFolderDataset)
    assert small.crop_note() == ("2 of 2 tiles are larger than --image-size 600 (up to 1024x1024): each is "
                                 "centre-cropped to it, the rest unseen; to train on all of such an image, make it a "
                                 "slide (a pyramidal TIFF, or a TIFF at least twice --image-size: tiled)")
    assert open_pathology(plain_slides, SIDE).crop_note() is None


def test_train_on_a_folder_of_plain_tiff_slides_reads_their_tissue_tiles(plain_slides, capsys, tmp_path):
    """The acceptance: two plain 1024-px TIFF slides in class folders train on the tiles of their tissue (12),
    not on two centre crops, and the checkpoint records the tags' MPP."""
    from mpi4dl_nb.checkpoint.files import list_checkpoints
    from mpi4dl_nb.checkpoint.record import read_checkpoint

    code, out, err = run_train([*RUN, "--datapath", str(plain_slides), "--checkpoint-dir", str(tmp_path / "ck")],
                               capsys)
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["classes"] == ["benign", "tumour"] and "centre-cropped" not in err, err
    record = read_checkpoint(list_checkpoints(tmp_path / "ck")[-1].path).record
    assert str(record.identity["data"]).startswith("SlideDataset, 12 images") and record.data.mpp == 0.5


def test_a_plain_tiff_beside_a_pyramidal_one_is_read_and_a_huge_one_is_refused_naming_how(tmp_path, monkeypatch):
    (tmp_path / "mixed" / "a").mkdir(parents=True)
    write_pyramid(tmp_path / "mixed" / "a" / "pyramid.tif", tissue_image(0, 0), levels=3)
    plain = write_plain(tmp_path / "mixed" / "b" / "plain.tif", tissue_image(512, 1))
    dataset = open_pathology(tmp_path / "mixed", TILE)
    assert isinstance(dataset, SlideDataset) and len(dataset.paths) == 2
    assert check_file(plain, SourceKind.SLIDES, TILE) is None                  # not "OpenSlide cannot open it"
    monkeypatch.setattr(pathology, "PLAIN_TIFF_PIXELS", SIDE * SIDE - 1)
    problem = check_file(plain, SourceKind.SLIDES, TILE)
    assert problem is not None and problem.startswith(f"a plain TIFF, not pyramidal, of {SIDE}x{SIDE} px"), problem
    assert "vips tiffsave plain.tif out.tif --tile --pyramid" in problem


def test_train_says_a_tile_folder_s_larger_images_are_centre_cropped(tmp_path, capsys):
    from PIL import Image

    rng = np.random.default_rng(0)
    for name, side in (("a", 40), ("a", 32), ("b", 32), ("b", 48)):
        (tmp_path / "tiles" / name).mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(
            tmp_path / "tiles" / name / f"t{side}.png")
    flags = [*RUN[:RUN.index("--image-size")], "--image-size", "32", *RUN[RUN.index("--batch-size"):]]
    code, _, err = run_train([*flags, "--datapath", str(tmp_path / "tiles")], capsys)
    assert code == 0, err
    said = [line for line in err.splitlines() if "centre-cropped" in line]
    assert said == ["mpi4dl_nb train: 2 of 4 tiles are larger than --image-size 32 (up to 48x48): each is "
                    "centre-cropped to it, the rest unseen; to train on all of such an image, make it a slide (a "
                    "pyramidal TIFF, or a TIFF at least twice --image-size: tiled)"], err
