"""Datasets: region reads equal crops of full reads, OpenSlide pyramids, CIFAR-10, the IHC sample, clear errors."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mpi4dl_nb.data import (
    Batcher,
    Cifar10Dataset,
    IHCSampleDataset,
    SlideDataset,
    SyntheticDataset,
    TileFolderDataset,
    ihc_image,
    make_dataset,
    open_pathology,
)
from mpi4dl_nb.data.cifar import RECORD
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.support.pyramid import write_pyramid
from tests.support.slide_recorder import ReadRecorder

tifffile = pytest.importorskip("tifffile")
openslide = pytest.importorskip("openslide")


@pytest.fixture(scope="module")
def slide_path(tmp_path_factory) -> Path:
    """768x1024 slide: two IHC patches (tissue) on a white background."""
    image = np.full((768, 1024, 3), 255, np.uint8)
    ihc = ihc_image()[:256, :256]
    image[:256, :256] = ihc
    image[512:768, 512:768] = ihc
    path = tmp_path_factory.mktemp("slides") / "slide.tif"
    write_pyramid(path, image)
    return path


def test_synthetic_region_equals_crop_and_is_reproducible():
    data = SyntheticDataset(100, num_classes=7, num_samples=5, seed=3)
    full = data.read(2)
    assert full.shape == (3, 100, 100) and 0.0 <= full.min() and full.max() < 1.0
    assert torch.equal(data.read(2, (10, 70, 33, 99)), full[:, 10:70, 33:99])
    assert torch.equal(SyntheticDataset(100, 7, 5, seed=3).read(2), full)
    assert not torch.equal(SyntheticDataset(100, 7, 5, seed=4).read(2), full)
    assert {data.label(i) for i in range(5)} <= set(range(7))


def test_slide_tiles_tissue_filter_and_levels(slide_path):
    data = open_pathology(slide_path, 128)
    assert isinstance(data, SlideDataset)
    corners = {(t.x, t.y) for t in data.tiles}
    # tissue only in the two IHC patches: 4 tiles each (128 px tiles of 256 px patches), minus
    # tiles the IHC image leaves mostly unstained
    assert corners <= {(x, y) for x in (0, 128, 512, 640) for y in (0, 128, 512, 640)}
    assert (0, 0) in corners and (512, 512) in corners and len(corners) >= 4
    everything = SlideDataset([slide_path], 128, min_tissue=0.0)
    assert len(everything) == (768 // 128) * (1024 // 128)
    level1 = SlideDataset([slide_path], 64, level=1)
    assert {(t.x, t.y) for t in level1.tiles} <= {(x, y) for x in (0, 64, 256, 320)
                                                  for y in (0, 64, 256, 320)}
    # level-1 pixels are the level-0 image downsampled by 2 (JPEG-close)
    a = level1.read(level1.tiles.index(next(t for t in level1.tiles if (t.x, t.y) == (0, 0))))
    b = data.read(data.tiles.index(next(t for t in data.tiles if (t.x, t.y) == (0, 0))))
    assert (a - b[:, ::2, ::2][:, :64, :64]).abs().mean() < 0.08


def test_slide_rank_reads_only_its_region(slide_path):
    """Each spatial rank's read asks OpenSlide for exactly its tile box, at the chosen level."""
    size, level = 64, 1
    data = SlideDataset([slide_path], size, level=level, opener=ReadRecorder.open)
    recorder = data.slide(0)
    index = len(data) - 1
    tile = data.tiles[index]
    whole = data.read(index)
    recorder.calls.clear()
    grid = TileGrid.from_slice_method("square", 4)
    pieces = []
    for t in range(grid.num_tiles):
        r0, r1, c0, c1 = grid.tile_box(t, size, size)
        pieces.append(data.read(index, (r0, r1, c0, c1)))
        location, lvl, region = recorder.calls[-1]
        assert lvl == level and region == (c1 - c0, r1 - r0)
        assert location == ((tile.x + c0) * 2, (tile.y + r0) * 2)   # level-0 coordinates
    assert len(recorder.calls) == grid.num_tiles
    top = torch.cat([pieces[0], pieces[1]], dim=2)
    bottom = torch.cat([pieces[2], pieces[3]], dim=2)
    assert torch.equal(torch.cat([top, bottom], dim=1), whole)


def test_slide_errors(slide_path, tmp_path):
    with pytest.raises(FileNotFoundError, match="--datapath"):
        open_pathology(tmp_path / "missing.svs", 64)
    bad = tmp_path / "broken.svs"
    bad.write_bytes(b"not a slide at all")
    with pytest.raises(ValueError, match="cannot read slide"):
        SlideDataset([bad], 64)
    with pytest.raises(ValueError, match="larger than slide .* level 2 .*256x192.*--image-size <= 192"):
        SlideDataset([slide_path], 256, level=2)
    with pytest.raises(ValueError, match="level 5 does not exist"):
        SlideDataset([slide_path], 64, level=5)


def test_slide_folder_with_class_folders(slide_path, tmp_path):
    for name in ("benign", "tumor"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.tif").write_bytes(slide_path.read_bytes())
    data = open_pathology(tmp_path, 128)
    assert isinstance(data, SlideDataset) and data.classes == ["benign", "tumor"]
    assert data.num_classes == 2
    assert {data.label(i) for i in range(len(data))} == {0, 1}
    with pytest.raises(ValueError, match="--num-classes 2"):
        open_pathology(tmp_path, 128, num_classes=1)


def test_tile_folder(tmp_path):
    from PIL import Image

    ihc = ihc_image()
    for name, patch in (("a", ihc[:100, :120]), ("b", ihc[200:300, 100:220])):
        (tmp_path / name).mkdir()
        Image.fromarray(patch).save(tmp_path / name / "t.png")
    data = open_pathology(tmp_path, 96)
    assert isinstance(data, TileFolderDataset) and len(data) == 2 and data.num_classes == 2
    image = data.read(0)
    expected = torch.from_numpy(ihc[2:98, 12:108].transpose(2, 0, 1).copy()).float() / 255
    assert torch.allclose(image, expected)
    assert torch.equal(data.read(1, (0, 48, 48, 96)), data.read(1)[:, :48, 48:])
    with pytest.raises(ValueError, match="smaller than --image-size 128; use --image-size <= 100"):
        TileFolderDataset(tmp_path, 128).read(0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no image tiles"):
        TileFolderDataset(tmp_path / "empty", 32)


def write_cifar_batch(path: Path, labels: list[int], seed: int) -> np.ndarray:
    """A CIFAR-10 binary batch: per record one label byte, then R, G, B planes of 32x32."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (len(labels), 3, 32, 32), dtype=np.uint8)
    records = np.concatenate([np.array(labels, np.uint8)[:, None],
                              pixels.reshape(len(labels), -1)], axis=1)
    assert records.shape[1] == RECORD
    path.write_bytes(records.tobytes())
    return pixels


def test_cifar_binary_batches(tmp_path):
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    p1 = write_cifar_batch(folder / "data_batch_1.bin", [3, 9, 0], seed=1)
    p2 = write_cifar_batch(folder / "data_batch_2.bin", [5, 1], seed=2)
    write_cifar_batch(folder / "test_batch.bin", [7], seed=3)
    data = Cifar10Dataset(tmp_path)
    assert len(data) == 5 and [data.label(i) for i in range(5)] == [3, 9, 0, 5, 1]
    assert torch.equal(data.read(3), torch.from_numpy(p2[0]).float() / 255)
    assert torch.equal(data.read(2, (4, 20, 8, 32)), torch.from_numpy(p1[2, :, 4:20, 8:32]).float() / 255)
    assert len(Cifar10Dataset(folder, train=False)) == 1
    big = Cifar10Dataset(tmp_path, 64)
    assert big.read(0).shape == (3, 64, 64)
    made = make_dataset("cifar", 32, 10, datapath=tmp_path)
    assert torch.equal(made.read(1), data.read(1))
    (folder / "data_batch_3.bin").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match="not a whole number of 3073-byte"):
        Cifar10Dataset(tmp_path)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(FileNotFoundError, match="no CIFAR-10 binary batches"):
        Cifar10Dataset(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="needs --datapath"):
        make_dataset("cifar", 32, 10)


def test_ihc_sample_default_medical():
    data = make_dataset("medical", 128, 2)
    assert isinstance(data, IHCSampleDataset)
    assert len(data) == 49 * 8    # 7x7 crops at stride 64, 8 rotations/flips each
    labels = [data.label(i) for i in range(len(data))]
    assert set(labels) == {0, 1} and abs(labels.count(0) - labels.count(1)) <= 16
    x = data.read(9)
    assert x.shape == (3, 128, 128)
    assert torch.equal(torch.rot90(data.read(8), 1, dims=(1, 2)), x)   # crop 1, quarter turn
    assert torch.equal(data.read(9, (5, 50, 60, 128)), x[:, 5:50, 60:])
    # real stained tissue, not noise: neighbouring pixels are strongly correlated
    flat0, flat1 = x[:, :, :-1].reshape(-1), x[:, :, 1:].reshape(-1)
    assert torch.corrcoef(torch.stack([flat0, flat1]))[0, 1] > 0.8
    assert IHCSampleDataset(1024).read(0).shape == (3, 1024, 1024)


def test_ihc_sample_whole_crops_held_out_share_no_pixel_with_training():
    """Non-overlapping crops (stride = size) held out with every rotation: no held-out pixel is trained on."""
    data = IHCSampleDataset(128, num_classes=2, stride=128)
    assert len(data.corners) == 16 and sorted(data.crop_labels) == [0] * 8 + [1] * 8   # split at the median crop
    held = data.items([2, 5])
    assert held == list(range(16, 24)) + list(range(40, 48))
    assert {data.label(i) for i in data.items([2])} == {data.crop_labels[2]}
    rest = sorted(set(range(len(data))) - set(held))
    assert data.items([c for c in range(16) if c not in (2, 5)]) == rest
    taken = {data.corners[i // 8] for i in rest}
    assert all(abs(y - y2) >= 128 or abs(x - x2) >= 128 for y, x in (data.corners[2], data.corners[5])
               for y2, x2 in taken)


def test_batcher_is_deterministic_and_region_aware():
    data = SyntheticDataset(32, 4, 10)
    batcher = Batcher(data, 4, seed=1)
    assert batcher.steps_per_epoch == 2
    first = batcher.indices(0, 0) + batcher.indices(0, 1)
    assert len(set(first)) == 8
    assert batcher.indices(1, 0) != batcher.indices(0, 0)   # reshuffled per epoch
    assert Batcher(data, 4, seed=1).indices(1, 1) == batcher.indices(1, 1)
    images = batcher.images(0, 1)
    assert images.shape == (4, 3, 32, 32)
    assert torch.equal(batcher.images(0, 1, (0, 16, 8, 32), rows=[2, 3]), images[2:, :, :16, 8:])
    assert batcher.labels(0, 1).tolist() == [data.label(i) for i in batcher.indices(0, 1)]
    with pytest.raises(ValueError, match="--batch-size"):
        Batcher(data, 11)
