"""The data check: unusable files found from headers and structure, split across ranks, with progress."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from mpi4dl_nb.data.validate import SourceKind, check_file, dataset_fingerprint, find_sources
from mpi4dl_nb.run.data_check import check_data
from tests.support.bad_data import flip_bytes, png_with_bad_pixel_data, truncate, write_tiles
from tests.support.pyramid import write_pyramid


def test_tile_faults_are_found_without_decoding(tmp_path):
    from PIL import Image

    good, corrupt, cut, later = write_tiles(tmp_path, per_class=2)
    flip_bytes(corrupt)
    truncate(cut, 0.5)
    png_with_bad_pixel_data(later)
    assert check_file(good, SourceKind.TILES, 32) is None
    assert "damaged or truncated PNG" in check_file(corrupt, SourceKind.TILES, 32)
    assert "truncated" in check_file(cut, SourceKind.TILES, 32).lower()
    assert check_file(later, SourceKind.TILES, 32) is None      # checksums fine: only decoding finds it
    assert "smaller than --image-size 64" in check_file(good, SourceKind.TILES, 64)
    jpeg = tmp_path / "t.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (200, 200, 3), np.uint8)).save(jpeg)
    assert check_file(jpeg, SourceKind.TILES, 32) is None
    assert "no end-of-image marker" in check_file(truncate(jpeg, 0.7), SourceKind.TILES, 32)
    deep = tmp_path / "deep.png"
    Image.fromarray(np.full((40, 40), 300, np.uint16)).save(deep)
    assert "pixel mode I;16" in check_file(deep, SourceKind.TILES, 32)
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not an image")
    assert "unreadable" in check_file(junk, SourceKind.TILES, 32)


def test_slides_are_found_by_headers_and_checked(tmp_path):
    from mpi4dl_nb.data import ihc_image

    image = np.full((256, 256, 3), 255, np.uint8)
    image[:192, :192] = ihc_image()[:192, :192]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        write_pyramid(tmp_path / name / "s.tif", image)
    truncate(tmp_path / "b" / "s.tif", 0.6)
    sources = find_sources("medical", tmp_path)
    assert sources.kind is SourceKind.SLIDES and len(sources.files) == 2
    assert check_file(tmp_path / "a" / "s.tif", SourceKind.SLIDES, 64) is None
    assert "truncated TIFF" in check_file(tmp_path / "b" / "s.tif", SourceKind.SLIDES, 64)
    assert "smaller than --image-size 512" in check_file(tmp_path / "a" / "s.tif", SourceKind.SLIDES, 512)
    assert "no level 5" in check_file(tmp_path / "a" / "s.tif", SourceKind.SLIDES, 32, level=5)
    assert find_sources("synthetic", None).files == ()


class Ranks:
    """Two ranks run one after the other: all_gather_object returns both ranks' shares."""

    def __init__(self, rank: int, shares: list) -> None:
        self.rank, self.world_size, self.shares = rank, 2, shares

    def all_gather_object(self, obj):
        self.shares[self.rank] = obj
        return list(self.shares)


def test_ranks_check_disjoint_shares_and_agree(tmp_path):
    paths = write_tiles(tmp_path, per_class=110, size=34)
    for index in (3, 150):
        flip_bytes(paths[index])
    sources = find_sources("medical", tmp_path)
    shares: list = [[], []]
    stream = io.StringIO()
    check_data(Ranks(1, shares), sources, 32, stream=io.StringIO())       # rank 1 first
    report = check_data(Ranks(0, shares), sources, 32, stream=stream)
    assert report.total == 220 and sorted(report.bad_paths) == sorted([paths[3], paths[150]])
    assert "checking data: ~220/220 files (2 ranks in parallel)" in stream.getvalue()
    assert "2 of 220 files" in report.refusal(tmp_path) and "the other 218" in report.refusal(tmp_path)


def test_fingerprint_follows_content_not_location(tmp_path):
    from mpi4dl_nb.data import TileFolderDataset

    write_tiles(tmp_path / "x", per_class=2)
    first = dataset_fingerprint(TileFolderDataset(tmp_path / "x", 32))
    (tmp_path / "x").rename(tmp_path / "y")
    assert dataset_fingerprint(TileFolderDataset(tmp_path / "y", 32)) == first
    Path(tmp_path / "y" / "a" / "tile0.png").unlink()
    assert dataset_fingerprint(TileFolderDataset(tmp_path / "y", 32)) != first
    pytest.importorskip("openslide")
