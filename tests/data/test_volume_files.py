"""Volume files: TIFF stacks (plain, ImageJ, OME, compressed, RGB) and NIfTI read as (C, D, H, W) = (C, z, y, x) with
their voxel size in micrometres; a region reads only its pages / sub-volume; unreadable files are named."""

import numpy as np
import pytest

from mpi4dl_nb.data.volume.files import VolumeInfo, read_volume, volume_info, volume_stem
from mpi4dl_nb.errors import ConfigError
from tests.support.requirements import VOLUMES_EXTRA, required_module

nibabel = required_module("nibabel", "volume file tests", VOLUMES_EXTRA)
tifffile = required_module("tifffile", "volume file tests", VOLUMES_EXTRA)

REGION = (slice(2, 5), slice(1, 4), slice(3, 9))


def stack(depth=7, height=6, width=10, dtype=np.uint16):
    return np.arange(depth * height * width, dtype=dtype).reshape(depth, height, width)


def test_plain_and_compressed_tiff_stacks_read_whole_and_by_region(tmp_path):
    zyx = stack()
    tifffile.imwrite(tmp_path / "plain.tif", zyx, photometric="minisblack")
    with tifffile.TiffWriter(tmp_path / "pages.tiff") as writer:   # one zlib page per slice, no shape metadata
        for plane in zyx:
            writer.write(plane, compression="zlib", photometric="minisblack", metadata=None)
    for name in ("plain.tif", "pages.tiff"):
        info = volume_info(tmp_path / name)
        assert info == VolumeInfo(tmp_path / name, (7, 6, 10), 1, np.dtype(np.uint16), None)
        whole = read_volume(tmp_path / name)
        assert whole.shape == (1, 7, 6, 10) and whole.dtype == np.uint16 and np.array_equal(whole[0], zyx)
        assert np.array_equal(read_volume(tmp_path / name, REGION)[0], zyx[REGION])


def test_a_region_decodes_only_the_pages_of_its_depth_range(tmp_path, monkeypatch):
    zyx = stack()
    with tifffile.TiffWriter(tmp_path / "z.tif") as writer:
        for plane in zyx:
            writer.write(plane, compression="zlib", photometric="minisblack", metadata=None)
    decoded: list[int] = []
    for cls in (tifffile.TiffPage, tifffile.TiffFrame):
        original = cls.asarray

        def spy(self, *args, _original=original, **kwargs):
            decoded.append(self.index)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(cls, "asarray", spy)
    assert np.array_equal(read_volume(tmp_path / "z.tif", REGION)[0], zyx[REGION])
    assert sorted(decoded) == [2, 3, 4]
    decoded.clear()
    tifffile.imwrite(tmp_path / "raw.tif", zyx, photometric="minisblack")   # contiguous: memory-mapped, no decode
    assert np.array_equal(read_volume(tmp_path / "raw.tif", REGION)[0], zyx[REGION])
    assert decoded == []


def test_imagej_and_ome_voxel_sizes_and_channels(tmp_path):
    zyx = stack()
    tifffile.imwrite(tmp_path / "ij.tif", zyx, imagej=True, resolution=(1 / 0.5, 1 / 0.25),
                     metadata={"spacing": 2.0, "unit": "um", "axes": "ZYX"})
    assert volume_info(tmp_path / "ij.tif").voxel_size == pytest.approx((2.0, 0.25, 0.5))   # resolution is (x, y)
    czyx = np.stack([zyx, zyx + 1000])
    tifffile.imwrite(tmp_path / "ome.ome.tif", czyx, ome=True,
                     metadata={"axes": "CZYX", "PhysicalSizeX": 300, "PhysicalSizeXUnit": "nm",
                               "PhysicalSizeY": 0.3, "PhysicalSizeZ": 1.5})
    info = volume_info(tmp_path / "ome.ome.tif")
    assert info.shape == (7, 6, 10) and info.channels == 2 and info.voxel_size == pytest.approx((1.5, 0.3, 0.3))
    assert np.array_equal(read_volume(tmp_path / "ome.ome.tif"), czyx)
    region = read_volume(tmp_path / "ome.ome.tif", REGION)
    assert np.array_equal(region, czyx[(slice(None), *REGION)])
    zyxs = np.stack([zyx % 256, zyx // 7 % 256, zyx // 3 % 256], axis=-1).astype(np.uint8)
    tifffile.imwrite(tmp_path / "rgb.tif", zyxs, photometric="rgb")
    info = volume_info(tmp_path / "rgb.tif")
    assert info.shape == (7, 6, 10) and info.channels == 3 and info.dtype == np.uint8
    assert np.array_equal(read_volume(tmp_path / "rgb.tif", REGION), np.moveaxis(zyxs, 3, 0)[(slice(None), *REGION)])


def test_nifti_is_transposed_from_xyz_to_zyx_with_its_voxel_size(tmp_path):
    zyx = stack(dtype=np.int16)
    xyz = zyx.transpose(2, 1, 0)
    image = nibabel.Nifti1Image(xyz, np.diag([0.4, 0.5, 3.0, 1.0]))
    image.header.set_xyzt_units("mm")
    nibabel.save(image, tmp_path / "v.nii.gz")
    info = volume_info(tmp_path / "v.nii.gz")
    assert info == VolumeInfo(tmp_path / "v.nii.gz", (7, 6, 10), 1, np.dtype(np.int16), pytest.approx((3e3, 5e2, 4e2)),
                              info.space)
    assert info.space is not None and info.space.unit == "mm" and info.orientation.codes == "RAS"   # stored RAS
    assert volume_stem(info.path) == "v"
    assert np.array_equal(read_volume(tmp_path / "v.nii.gz")[0], zyx)
    assert np.array_equal(read_volume(tmp_path / "v.nii.gz", REGION)[0], zyx[REGION])
    unknown = nibabel.Nifti1Image(np.stack([xyz, -xyz], axis=-1), np.eye(4))      # 4-D: channels last
    nibabel.save(unknown, tmp_path / "c.nii")
    info = volume_info(tmp_path / "c.nii")
    assert info.channels == 2 and info.voxel_size is None                            # unit not given
    assert np.array_equal(read_volume(tmp_path / "c.nii", REGION), np.stack([zyx, -zyx])[(slice(None), *REGION)])


def test_unreadable_and_flat_files_are_refused_naming_the_file(tmp_path):
    (tmp_path / "broken.tif").write_bytes(b"not a tiff at all")
    (tmp_path / "broken.nii").write_bytes(b"\0" * 10)
    (tmp_path / "v.raw").write_bytes(b"\0")
    tifffile.imwrite(tmp_path / "flat.tif", np.zeros((6, 10), np.uint8))
    nibabel.save(nibabel.Nifti1Image(np.zeros((10, 6), np.float32), np.eye(4)), tmp_path / "flat.nii")
    expected = {"broken.tif": "cannot read it as a volume", "broken.nii": "cannot read it as a volume",
                "v.raw": "not a volume file", "flat.tif": "not a volume", "flat.nii": "a 2-D image",
                "missing.tif": "no such volume file"}
    for name, words in expected.items():
        with pytest.raises(ConfigError, match=words) as err:
            volume_info(tmp_path / name)
        assert str(tmp_path / name) in str(err.value)
        with pytest.raises(ConfigError, match=words):
            read_volume(tmp_path / name)


def data_ends(path):
    """The byte after each page's image data."""
    with tifffile.TiffFile(path) as tif:
        return [max(o + n for o, n in zip(p.dataoffsets, p.databytecounts)) for p in tif.pages]


@pytest.mark.parametrize("kind", ["imagej", "shaped", "zlib pages"])
@pytest.mark.parametrize("page", [3, 7])
def test_a_truncated_stack_is_refused_as_truncated_naming_the_file_and_what_it_promised(tmp_path, capfd, kind, page):
    """Issue 51: a stack cut short was called "a 2-D image (one page)"; said truncated, with what could be read
    (cut inside page 3's or the last page's voxels)."""
    whole, cut = tmp_path / "whole.tif", tmp_path / "cut.tif"
    volume = stack(depth=8, height=16, width=16)
    if kind == "zlib pages":
        tifffile.imwrite(whole, volume, compression="zlib")
    else:
        tifffile.imwrite(whole, volume, imagej=kind == "imagej", metadata={"axes": "ZYX"})
    cut.write_bytes(whole.read_bytes()[:data_ends(whole)[page] - 7])
    assert volume_info(whole).shape == (8, 16, 16)
    promised = "ImageJ metadata promises 8 pages" if kind == "imagej" else "promises shape (8, 16, 16)"
    for read in (volume_info, read_volume):
        with pytest.raises(ConfigError, match="truncated") as err:
            read(cut)
        message = str(err.value)
        assert str(cut) in message and "2-D image" not in message and "copy" in message, message
        if "can be read" in message:     # what the file holds and promised, where its pages say
            assert "of (16, 16) can be read" in message and promised in message, message
    assert "invalid page offset" not in capfd.readouterr().err      # said once, in the refusal, not printed


def test_an_imagej_stack_whose_metadata_calls_its_pages_channels_reads_as_the_volume_it_is(tmp_path):
    """Issue 65: ``tifffile.imwrite(..., imagej=True)`` without ``axes='ZYX'`` labels 16 depth slices as channels;
    it was called "a 2-D image (one page, shape (16, 32, 32))". Shown as grey levels, its pages are read as depth;
    shown as colours (a multichannel image), it is refused saying what ImageJ calls the pages and how to relabel."""
    zyx = stack(depth=16, height=32, width=32)
    tifffile.imwrite(tmp_path / "stack.tif", zyx, imagej=True)
    with tifffile.TiffFile(tmp_path / "stack.tif") as tif:      # what tifffile reports: channels, no slices
        assert tif.series[0].axes == "CYX" and "slices" not in tif.imagej_metadata
    assert volume_info(tmp_path / "stack.tif") == VolumeInfo(tmp_path / "stack.tif", (16, 32, 32), 1,
                                                             np.dtype(np.uint16), None)
    assert np.array_equal(read_volume(tmp_path / "stack.tif", REGION)[0], zyx[REGION])
    tifffile.imwrite(tmp_path / "colours.tif", zyx[:3], imagej=True, metadata={"mode": "composite"})
    with pytest.raises(ConfigError, match=r"a 2-D image of 3 channel pages .* its ImageJ metadata calls the 3 pages "
                                          r"channels \(no slices\), shown as composite: if the pages are depth slices, "
                                          r"label them so \(ImageJ: Image > Properties, slices=3 channels=1") as err:
        volume_info(tmp_path / "colours.tif")
    assert str(tmp_path / "colours.tif") in str(err.value) and "one page" not in str(err.value)
