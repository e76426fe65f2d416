"""Issue 65: the outputs of a NIfTI scan keep its space. ``infer --volume`` over an oblique, axis-swapped CT-like scan
(origin (-120, -95, 30) mm, 0.8 x 0.8 x 2.5 mm voxels) writes masks of its shape, affine, codes and unit, the labels
those of the network on the scan in RAS axes put back in the scan's grid; a strided output's cells sit at the centres
of their voxels, a reversed axis included."""

import json

import numpy as np
import pytest

from mpi4dl_nb.data.volume.files import volume_info
from mpi4dl_nb.data.volume.writer import VolumeWriter
from tests.mpi import volume_infer
from tests.support.requirements import VOLUMES_EXTRA, required_module

nibabel = required_module("nibabel", "volume scan space tests", VOLUMES_EXTRA)
orientations = required_module("nibabel.orientations", "volume scan space tests", VOLUMES_EXTRA)

GRID = (12, 10, 6)                  # stored x, y, z


def scan_affine(degrees=15.0):
    """Stored i along posterior, j along right, k along superior, tilted ``degrees`` about x (a gantry tilt)."""
    t = np.radians(degrees)
    tilt = np.array([[1, 0, 0], [0, np.cos(t), -np.sin(t)], [0, np.sin(t), np.cos(t)]])
    out = np.eye(4)
    out[:3, :3] = tilt @ np.array([[0, 1, 0], [-1, 0, 0], [0, 0, 1]]) @ np.diag([0.8, 0.8, 2.5])
    out[:3, 3] = (-120.0, -95.0, 30.0)
    return out


def write_scan(path, data, matrix):
    image = nibabel.Nifti1Image(data, None)
    image.header.set_qform(matrix, code=1)          # scanner
    image.header.set_sform(matrix, code=2)          # aligned: a mix-up of the two codes shows
    image.header.set_xyzt_units("mm")
    nibabel.save(image, path)
    return nibabel.load(str(path))


def test_infer_volume_writes_the_masks_of_a_scan_in_its_grid_affine_and_unit(tmp_path, capsys):
    from mpi4dl_nb.cli.infer_cmd import main as infer_main
    from mpi4dl_nb.models.spec import ModelSpec
    from tests.support.infer_data import write_network

    spec = ModelSpec.of("unet3d", num_layers=1, num_filters=2, num_classes=volume_infer.CLASSES, in_channels=1,
                        upsampling="transposed")
    write_network(tmp_path / "ck", volume_infer.network(), spec, 16, ("background", "cell", "nucleus"))
    data = np.random.default_rng(5).integers(0, 32767, GRID).astype(np.int16)
    scan = write_scan(tmp_path / "ct.nii.gz", data, scan_affine())
    assert infer_main(["--checkpoint", str(tmp_path / "ck"), "--volume", str(tmp_path / "ct.nii.gz"), "--output",
                       str(tmp_path / "mask.nii.gz"), "--dtype", "float64", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["orientation"] == "PRS, oblique 15.0°" and summary["shape"] == [6, 12, 10]
    ornt = orientations.io_orientation(scan.affine)                  # nibabel's closest canonical, independently
    back = orientations.ornt_transform(orientations.axcodes2ornt("RAS"), ornt)
    canonical = orientations.apply_orientation(data, ornt)
    assert np.array_equal(orientations.apply_orientation(canonical, back), data)
    want = volume_infer.whole_volume(canonical.transpose(2, 1, 0)[None] / 32767.0)
    for name in ("mask.nii.gz", "mask_prob1.nii.gz"):
        out = nibabel.load(str(tmp_path / name))
        assert out.shape == GRID and np.abs(out.affine - scan.affine).max() < 1e-5, name
        assert np.abs(out.header.get_qform() - scan.header.get_qform()).max() < 1e-5
        assert (int(out.header["qform_code"]), int(out.header["sform_code"])) == (1, 2)
        assert out.header.get_xyzt_units()[0] == "mm" and out.header.get_zooms() == pytest.approx((0.8, 0.8, 2.5))
    labels = np.asarray(nibabel.load(str(tmp_path / "mask.nii.gz")).dataobj)
    assert np.array_equal(labels, orientations.apply_orientation(want.argmax(0).transpose(2, 1, 0), back))
    prob = np.asarray(nibabel.load(str(tmp_path / "mask_prob1.nii.gz")).dataobj)
    assert float(np.abs(prob - orientations.apply_orientation(want[1].transpose(2, 1, 0), back)).max()) < 1e-6


def test_a_strided_output_places_each_cell_at_the_centre_of_its_voxels(tmp_path):
    """Stride 2 on 11 x 7 x 5 voxels (odd sides: the last cell passes the end) with reversed and swapped axes: the
    world position of every written cell is the centre of the 2 x 2 x 2 voxels it covers in RAS axes."""
    matrix = np.eye(4)
    matrix[:3, :3] = np.array([[0, -1, 0], [0, 0, 1], [-1, 0, 0]]).T * [0.5, 0.7, 2.0]     # i: P, j: S, k: L
    matrix[:3, 3] = (10.0, -20.0, 5.0)
    scan = write_scan(tmp_path / "scan.nii", np.zeros((11, 7, 5), np.int16), matrix)
    info = volume_info(tmp_path / "scan.nii")
    assert info.space is not None
    cells = tuple(-(-n // 2) for n in info.shape)
    writer = VolumeWriter(tmp_path / "cells.nii", cells, np.dtype(np.float64), None, info.space.at_stride((2, 2, 2)))
    writer.write(((0, cells[0]), (0, cells[1]), (0, cells[2])), np.arange(np.prod(cells), dtype=np.float64)
                 .reshape(cells))
    writer.close()
    out = nibabel.load(str(tmp_path / "cells.nii"))
    canonical = nibabel.as_closest_canonical(scan).affine
    grid = np.stack(np.meshgrid(*(np.arange(n) for n in out.shape), indexing="ij"), -1).reshape(-1, 3)
    d, h, w = np.unravel_index(np.asarray(out.dataobj).reshape(-1).astype(int), cells)
    centres = np.stack([2 * w + 0.5, 2 * h + 0.5, 2 * d + 0.5], -1)            # canonical x, y, z of each cell
    world = grid @ out.affine[:3, :3].T + out.affine[:3, 3]
    assert np.abs(world - (centres @ canonical[:3, :3].T + canonical[:3, 3])).max() < 1e-5
