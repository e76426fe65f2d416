"""A transformer classifier over a slide (issue 66): a timm ViT trained by the real ``train`` command has no fully
convolutional form, so it maps lone tiles (``--map-mode tiles``): 4 ranks (mpiexec) write exactly the map of one
process (float64), every cell the ViT on its lone tile; ``--map-mode dense`` is refused in one line naming
``--map-mode tiles``; ``--map-mode auto`` (the default, issue 81) chooses tiles, says so in one line and writes the
same map, its progress line with the rate and the time left."""

from __future__ import annotations

import contextlib
import io
import re

import numpy as np
import pytest
import torch
from torch import nn

from mpi4dl_nb.cli.infer_cmd import main as infer_main
from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.infer.tile_map import MapMode, lone_tile_classes, refuse_dense_map
from mpi4dl_nb.models import build_model
from tests.infer.test_infer_refusals import one_line
from tests.mpi.infer_exact import lone_tiles
from tests.support.infer_data import make_slide
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

VIT = ["--model", "timm:vit_tiny_patch16_224", "--model-args", "depth=2,embed_dim=48,num_heads=2", "--image-size",
       "32", "--num-classes", "2", "--batch-size", "2", "--num-samples", "4", "--steps", "1", "--split-size", "1",
       "--spatial-size", "0", "--app", "medical", "--no-progress", "--dtype", "float64"]
STRIDE = 16          # half the 32 px tile: 9 x 20 cells on the 150 x 330 px slide, 8 x 19 whole tiles


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    """(folder, a ViT-Ti/16 checkpoint (2 blocks of width 48, 32 px tiles, one step), a 150 x 330 px slide)."""
    require_or_skip(missing_modules("timm"), "timm's vision transformers", MODELS_EXTRA)
    from mpi4dl_nb.cli.train_cmd import main as train_main

    root = tmp_path_factory.mktemp("vit-infer")
    with contextlib.redirect_stdout(io.StringIO()):
        assert train_main([*VIT, "--checkpoint-dir", str(root / "ck")]) == 0
    return root, root / "ck", make_slide(root / "slide.tif", 150, 330)


def tile_map(checkpoint, slide, out, *extra: str) -> list[str]:
    return ["--checkpoint", str(checkpoint), "--slide", str(slide), "--output", str(out), "--map-mode", "tiles",
            "--output-stride", str(STRIDE), "--dtype", "float64", "--no-progress", *extra]


@pytest.fixture(scope="module")
def one_process(vit):
    """The one-process tile map of the ViT (its ``.npy``)."""
    root, checkpoint, slide = vit
    with contextlib.redirect_stdout(io.StringIO()):
        assert infer_main(tile_map(checkpoint, slide, root / "one.npy")) == 0
    return np.load(root / "one.npy")


def test_only_whole_image_classifiers_without_a_fully_convolutional_form_map_lone_tiles():
    """A ResNet (a ClassifierHead) and a dense network are not lone-tile classifiers; a head that flattens the
    feature map into a Linear is (2 classes), and --map-mode dense of it is refused naming --map-mode tiles."""
    resnet = build_model("resnet", num_layers=8, num_filters=4, num_classes=2, version=1)
    dense = [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1)]
    flat = [nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.Flatten(), nn.Linear(4 * 16 * 16, 2)]
    assert lone_tile_classes(resnet, 32) is None and lone_tile_classes(dense, 32) is None
    assert lone_tile_classes(flat, 32) == 2 and lone_tile_classes(flat, 30) is None     # a size it cannot take
    refuse_dense_map(True, MapMode.TILES, "m")
    refuse_dense_map(False, MapMode.DENSE, "m")
    with pytest.raises(ConfigError, match="--map-mode: m sees each tile as a whole .* pass --map-mode tiles"):
        refuse_dense_map(True, MapMode.DENSE, "m")


def test_a_vit_is_a_classifier_of_lone_tiles(vit):
    """The checkpoint loads as a classifier (its record's task) of lone tiles: the cell grid is its 32 px tiles every
    32 px (side by side) unless --output-stride says otherwise, and each cell sees exactly its tile."""
    from mpi4dl_nb.data.task import Task
    from mpi4dl_nb.infer.fully_conv import measure_field
    from mpi4dl_nb.infer.probes import output_size
    from mpi4dl_nb.infer.trained import load_network

    _, checkpoint, _ = vit
    trained = load_network(str(checkpoint), dtype=torch.float64)
    assert trained.lone_tiles and trained.task is Task.CLASSIFICATION and trained.classes == ("0", "1")
    assert (trained.net.shape.stride, trained.net.shape.classes, trained.cell_extent) == (32, 2, 32)
    assert output_size(trained.net, 160, 352) == (5, 11)
    overlapping = load_network(str(checkpoint), dtype=torch.float64, output_stride=STRIDE).net
    rows, cols = measure_field(overlapping)
    assert overlapping.shape.stride == STRIDE and (rows.before, rows.after, cols.before, cols.after) == (0, 32, 0, 32)


def test_the_map_is_the_vit_on_each_lone_tile(vit, one_process):
    """Every cell whose tile lies on the slide is the trained ViT's softmax on that tile alone (float64); the rest
    hold no data (NaN)."""
    _, checkpoint, slide = vit
    expected = lone_tiles(checkpoint, slide, stride=STRIDE, shape=one_process.shape)
    assert one_process.shape == (2, 9, 20)
    assert np.array_equal(np.isnan(one_process), np.isnan(expected)) and np.isfinite(one_process[0]).sum() == 8 * 19
    assert np.nanmax(np.abs(one_process - expected)) < 1e-12


def test_four_ranks_equal_one_process(vit, one_process, mpirun):
    """``infer --slide`` on 4 ranks (mpiexec, the ranks sharing the rows of tiles) writes the one-process map (float64:
    the same no-data cells, values within 1e-12; bit for bit here, but a rank's single thread may sum in another
    order than the one process's threads)."""
    root, checkpoint, slide = vit
    mpirun(4, "mpi4dl_nb", "infer", *tile_map(checkpoint, slide, root / "four.npy", "--num-spatial-parts", "4"),
           module=True, timeout=300)
    four = np.load(root / "four.npy")
    assert four.shape == one_process.shape and np.array_equal(np.isnan(four), np.isnan(one_process))
    assert np.isfinite(four).any() and np.nanmax(np.abs(four - one_process)) < 1e-12


def test_a_dense_map_of_a_vit_is_refused_in_one_line(vit, tmp_path, capsys):
    """--map-mode dense has no fully convolutional ViT to run: refused before any work, naming --map-mode tiles;
    nothing is written."""
    _, checkpoint, slide = vit
    code = infer_main(["--checkpoint", str(checkpoint), "--slide", str(slide), "--output", str(tmp_path / "m.npy"),
                       "--map-mode", "dense", "--no-progress"])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and "--map-mode: timm:vit_tiny_patch16_224 sees each tile as a whole" in line
    assert "pass --map-mode tiles" in line and not list(tmp_path.iterdir())


def test_the_default_map_mode_maps_a_vit_tile_by_tile_and_says_so(vit, one_process, tmp_path, capsys):
    """No --map-mode (auto): the ViT's map is written, the same as --map-mode tiles; stderr says each part of the
    set-up, then auto's choice in one line, then a progress line per row of tiles with the rate and the time left
    (the format checked, not the figures). What tiles mode cannot do is refused naming auto's choice."""
    _, checkpoint, slide = vit
    argv = ["--checkpoint", str(checkpoint), "--slide", str(slide), "--output-stride", str(STRIDE), "--dtype",
            "float64"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert infer_main([*argv, "--output", str(tmp_path / "auto.npy")]) == 0
    assert np.array_equal(np.load(tmp_path / "auto.npy"), one_process, equal_nan=True)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("mpi4dl_nb infer: setting up: loading the checkpoint ") and lines[1] == (
        "mpi4dl_nb infer: --map-mode auto: tiles for timm:vit_tiny_patch16_224 (it sees each tile as a whole, so no "
        "fully convolutional form exists; each cell is the classifier on its lone tile); --map-mode dense|tiles "
        "chooses"), lines
    assert lines[2:4] == [f"mpi4dl_nb infer: setting up: opening the slide {slide} ...",
                          "mpi4dl_nb infer: setting up: planning the windows ..."], lines
    bars = lines[4:]
    assert len(bars) == 8 and all(re.fullmatch(r"\[[#.]{30}\] tile rows \d/8 \d+\.\d\d tiles/s ETA \d+:\d\d", b)
                                  for b in bars), bars
    assert bars[-1].startswith(f"[{'#' * 30}] tile rows 8/8 ") and bars[-1].endswith(" ETA 0:00")
    code = infer_main([*argv, "--output", str(tmp_path / "t.npy"), "--tissue-only", "--no-progress"])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and line.endswith("--map-mode: tiles (auto's choice: the network has no fully convolutional "
                                       "form) runs the whole slide in one go; drop --tissue-only")
