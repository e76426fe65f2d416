"""Volume inference (infer/volume.py): window geometry over three axes, one process and 2 spatial ranks exact against
the whole-volume 3-D U-Net (float64, 1e-9) with memory flat in the volume's size, the volume files written; a
swinunetr3d (every voxel depends on the whole volume) as one window, exact against its forward (1e-10)."""

from __future__ import annotations

import numpy as np
import pytest

import mpi4dl_nb as dl
from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.infer.windows import AxisField, AxisWindows, BoxPlan
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.mpi import volume_infer
from tests.support.battery import shared_job
from tests.support.requirements import VOLUMES_EXTRA, required_module

nibabel = required_module("nibabel", "volume inference tests", VOLUMES_EXTRA)
tifffile = required_module("tifffile", "volume inference tests", VOLUMES_EXTRA)

SPATIAL = "1x1x2"
JOB = shared_job(2, "volume_infer", SPATIAL, timeout=300)
FIELD = AxisField(stride=1, before=8, after=9, align=2)     # the test U-Net's field along every axis


def plan(extents: tuple[int, ...], parts: tuple[int, ...], window: int) -> BoxPlan:
    return BoxPlan(tuple(AxisWindows(name, FIELD, n, n, p, window, fit_whole=True)
                         for name, n, p in zip(("depth", "rows", "columns"), extents, parts)))


def test_box_plan_cores_tile_the_volume_and_inputs_hold_their_fields():
    boxes = plan((24, 66, 50), (1, 1, 2), 24)
    seen = np.zeros((24, 66, 50), dtype=int)
    for window in boxes.windows():
        seen[tuple(slice(a, b) for a, b in window.core)] += 1
        for (c0, c1), (i0, i1), extent in zip(window.core, window.input, (24, 66, 50)):
            assert i0 <= max(0, c0 - FIELD.before) and min(extent, c1 - 1 + FIELD.after) <= i1
        assert window.input_size == (24, 24, 48)                # one window size: 24 x 24 x (2 ranks x 24)
    assert (seen == 1).all()
    assert boxes.shape[0] == 1 and boxes.shape[1] > 1                       # depth fits a window: one along it
    first = boxes.windows()[0]
    tiles = [first.rank_extent(TileGrid(rows=1, cols=2, depth=1), t) for t in range(2)]   # the plan's 1x1x2
    x0 = first.input[2][0]
    assert tiles[0][:2] == tiles[1][:2] == first.input[:2] and (tiles[0][2], tiles[1][2]) == (
        (x0, x0 + 24), (x0 + 24, x0 + 48))


def test_box_plan_refuses_a_window_thinner_than_the_field():
    with pytest.raises(ConfigError, match="depth need 16 cells .* each of the 2 ranks .* use --window >= 10"):
        plan((32, 66, 50), (2, 2, 2), 8)


def test_one_process_equals_the_whole_volume_and_memory_stays_flat(tmp_path):
    ctx = dl.init()
    volume_infer.exact_run(ctx, "1x1x1", tmp_path)
    volume_infer.memory_run(ctx, "1x1x1", tmp_path)


def test_one_process_runs_a_whole_volume_network_as_one_window_equal_to_its_forward(tmp_path):
    volume_infer.whole_run(dl.init(), "1x1x1", tmp_path)


def test_two_spatial_ranks_equal_the_whole_volume_and_memory_stays_flat(shared_launch):
    shared_launch(JOB).require_clean([f"{name} on {SPATIAL}" for name in (volume_infer.EXACT, volume_infer.MEMORY,
                                                                          volume_infer.WHOLE)])


def test_a_2d_network_or_grid_is_refused_naming_the_flag(tmp_path):
    ctx = dl.init()
    vol = np.zeros((1, 8, 8, 8))
    with pytest.raises(ConfigError, match="--slice-method"):
        dl.infer_volume(volume_infer.network(), vol, None, ctx=ctx, num_spatial_parts=2, slice_method="vertical")
    from mpi4dl_nb.models.unet import unet

    with pytest.raises(ConfigError, match="3-D network"):
        dl.infer_volume(unet(1, 2, 2, in_channels=1), vol, None, ctx=ctx)
    with pytest.raises(ConfigError, match="--output"):
        dl.infer_volume(volume_infer.network(), vol, tmp_path / "seg.png", ctx=ctx)


def test_the_command_runs_a_checkpoint_over_a_tiff_stack_into_nifti_with_its_voxel_size(tmp_path, capsys):
    import json

    from mpi4dl_nb.cli.infer_cmd import main as infer_main
    from mpi4dl_nb.models.spec import ModelSpec
    from tests.support.infer_data import write_network

    spec = ModelSpec.of("unet3d", num_layers=1, num_filters=2, num_classes=volume_infer.CLASSES, in_channels=1,
                        upsampling="transposed")
    write_network(tmp_path / "ck", volume_infer.network(), spec, 16, ("background", "cell", "nucleus"))
    vol = (np.random.default_rng(3).random((20, 32, 44)) * 255).astype(np.uint8)    # read as training does: / 255
    z, y, x = volume_infer.VOXEL_SIZE
    tifffile.imwrite(tmp_path / "vol.tif", vol, imagej=True, resolution=(1 / x, 1 / y),
                     metadata={"spacing": z, "unit": "um", "axes": "ZYX"})
    args = ["--checkpoint", str(tmp_path / "ck"), "--volume", str(tmp_path / "vol.tif"), "--output",
            str(tmp_path / "seg.nii.gz")]
    assert infer_main([*args, "--window", "20,32,40", "--dtype", "float64", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["window_grid"] == [1, 1, 2] and summary["voxel_size"] == list(volume_infer.VOXEL_SIZE)
    want = volume_infer.whole_volume(vol[None] / 255.0)
    labels = nibabel.load(str(tmp_path / "seg.nii.gz"))
    assert tuple(float(v) for v in labels.header.get_zooms()) == (x, y, z)
    assert np.array_equal(np.asarray(labels.dataobj).transpose(2, 1, 0), want.argmax(0))
    prob = np.asarray(nibabel.load(str(tmp_path / "seg_prob2.nii.gz")).dataobj).transpose(2, 1, 0)
    assert prob.dtype == np.float32 and float(np.abs(prob - want[2]).max()) < 1e-6
    assert not (tmp_path / "seg.nii").exists()        # the uncompressed copy is gone
    assert infer_main([*args, "--tissue-only"]) == 2
    assert "--tissue-only: for slides, not a --volume" in capsys.readouterr().err
    assert infer_main([*args, "--output", str(tmp_path / "b.tif")]) == 2
    assert "give --output NAME.tif|.nii|.nii.gz once" in capsys.readouterr().err
    assert infer_main([*args, "--overwrite", "--num-spatial-parts", "2", "--slice-method", "1x1x2"]) == 2
    assert "2 ranks share each window but 1 were launched" in capsys.readouterr().err


def test_a_whole_volume_run_says_the_memory_per_rank_in_its_progress_line(capsys):
    """The ranks are the user's choice for a network that needs the whole volume: the progress line says what a rank
    holds (measured on two small volumes) before the one window runs."""
    import re

    vol = volume_infer.volume(volume_infer.WHOLE_VOLUME, 4)
    dl.infer_volume(volume_infer.swin_network(), vol, None, ctx=dl.init(), dtype="float64", progress=True)
    err = capsys.readouterr().err
    said = re.search(r"one window: the whole 16x16x32 volume .* on 1 rank\(s\), about (\d+) MiB per rank \(1/P", err)
    assert said is not None and int(said.group(1)) >= 1, err
