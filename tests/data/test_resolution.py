"""MPP from files, the level and resampling for a target resolution; resampled boxes equal the whole image's."""

from __future__ import annotations

import numpy as np
import pytest

from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.data.resolution import AreaResampler, choose_level, image_mpp, resolve_read, target_mpp


def zero_padded_reader(array):
    """A box reader of ``array`` (rows, columns, ...) that fills what lies outside it with zeros, as slides do."""
    def read(box):
        r0, r1, c0, c1 = box
        out = np.zeros((r1 - r0, c1 - c0, *array.shape[2:]), dtype=array.dtype)
        part = array[max(r0, 0):r1, max(c0, 0):c1]
        out[:part.shape[0], :part.shape[1]] = part
        return out
    return read


def test_levels_and_resampling_for_a_target():
    downsamples = [1.0, 2.0, 4.0]
    coarse = choose_level(0.25, downsamples, 1.0, "s")
    assert coarse.level == 2 and not coarse.resampled
    choice = choose_level(0.25, downsamples, 0.8, "s")
    assert (choice.level, choice.scale, choice.mpp) == (1, pytest.approx(1.6), 0.8)
    assert choose_level(0.25, downsamples, 0.505, "s").scale == 1.0        # within 2 %: the level as it is
    with pytest.raises(ConfigError, match="would invent detail: use --mpp >= 0.25"):
        choose_level(0.25, downsamples, 0.1, "s")
    with pytest.raises(ConfigError, match="--source-mpp"):
        resolve_read(None, downsamples, "s", target=None, level=None, trained_at=0.5)
    with pytest.raises(ConfigError, match="--slide-level: give --slide-level or --mpp"):
        resolve_read(0.25, downsamples, "s", target=0.5, level=1)
    assert target_mpp(None, 20.0) == 0.5


@pytest.mark.parametrize("scale", [1.25, 1.6, 2.0, 3.3])
def test_any_box_of_the_resampled_image_is_bitwise_the_whole_images(scale):
    rng = np.random.default_rng(0)
    source = rng.integers(0, 256, size=(97, 83, 3), dtype=np.uint8)

    read = zero_padded_reader(source)

    resampler = AreaResampler(scale)
    height, width = resampler.extent(97), resampler.extent(83)
    whole = resampler.read(read, (0, height, 0, width))
    assert np.array_equal(resampler.read(read, (3, 11, 5, width)), whole[3:11, 5:width])
    if scale == 2.0:
        expected = source[:2 * height, :2 * width].reshape(height, 2, width, 2, 3).mean(axis=(1, 3))
        assert np.abs(whole - expected).max() <= 0.5 + 1e-9                  # the mean of the pixels covered


def test_resolution_tags_of_images(tmp_path):
    import tifffile
    from PIL import Image

    tifffile.imwrite(tmp_path / "a.tif", np.zeros((8, 8, 3), np.uint8), resolution=(1e4 / 0.5, 1e4 / 0.5),
                     resolutionunit="CENTIMETER")
    tifffile.imwrite(tmp_path / "none.tif", np.zeros((8, 8, 3), np.uint8))
    Image.new("RGB", (8, 8)).save(tmp_path / "b.png", dpi=(25400 / 0.25, 25400 / 0.25))
    Image.new("RGB", (8, 8)).save(tmp_path / "screen.png", dpi=(72, 72))
    assert image_mpp(tmp_path / "a.tif") == pytest.approx(0.5) and image_mpp(tmp_path / "none.tif") is None
    assert image_mpp(tmp_path / "b.png") == pytest.approx(0.25) and image_mpp(tmp_path / "screen.png") is None


@pytest.mark.parametrize("scale", [1.25, 2.0, 3.3])
def test_labels_resampled_by_majority_any_box_alone_equals_the_whole(scale):
    rng = np.random.default_rng(1)
    labels = rng.choice(np.array([0, 2, 7, 255]), size=(61, 53), p=[0.4, 0.3, 0.2, 0.1])

    read = zero_padded_reader(labels)

    resampler = AreaResampler(scale)
    height, width = resampler.extent(61), resampler.extent(53)
    whole = resampler.vote(read, (0, height, 0, width))
    assert whole.dtype == np.int64 and set(np.unique(whole)) <= {0, 2, 7, 255}      # chosen, never interpolated
    assert np.array_equal(resampler.vote(read, (2, 9, 4, width)), whole[2:9, 4:width])
    if scale == 2.0:      # each pixel the most frequent label of its 2x2 block, a tie to the smaller label
        blocks = labels[:2 * height, :2 * width].reshape(height, 2, width, 2).transpose(0, 2, 1, 3).reshape(
            height, width, 4)
        values = np.array([0, 2, 7, 255])
        counts = (blocks[..., None] == values).sum(axis=2)
        assert np.array_equal(whole, values[np.argmax(counts, axis=2)])
