"""Slide-aligned outputs (a bright square found where it is, in level-0 coordinates), resolution by MPP, dense
(segmentation) inference with label maps and polygons, cohorts of slides; one process, hand-made checkpoints."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from mpi4dl_nb.cli.infer_cmd import main as infer_main
from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.infer.api import infer_slide
from tests.support.infer_data import (
    bright_detector,
    relative_difference,
    square_slide,
    tissue_image,
    unet_checkpoint,
    whole_reference,
    write_slide,
)

SQUARE = (96, 160, 200, 264)          # rows, columns of the bright square (level 0)


@pytest.fixture(scope="module")
def bright(tmp_path_factory):
    """A classifier trained at 1.0 µm/px that finds bright patches, and a 0.5 µm/px slide with a bright square."""
    root = tmp_path_factory.mktemp("bright")
    return root, bright_detector(root / "ck", mpp=1.0), square_slide(root / "s.tif", 320, 400, SQUARE, mpp=0.5)


@pytest.fixture(scope="module")
def unet(tmp_path_factory):
    """A 3-class U-Net checkpoint (0.5 µm/px) and a 150 x 200 tissue slide scanned at 0.5 µm/px."""
    root = tmp_path_factory.mktemp("unet")
    return root, unet_checkpoint(root / "ck", mpp=0.5), write_slide(root / "s.tif", tissue_image(150, 200), mpp=0.5)


def cli(*argv: object) -> int:
    return infer_main([str(a) for a in argv] + ["--no-progress"])


def test_the_bright_cells_fall_on_the_square_in_slide_coordinates(bright):
    import openslide
    import tifffile

    root, checkpoint, slide = bright
    assert cli("--checkpoint", checkpoint, "--slide", slide, "--output", root / "m.tif", "--output", root / "m.geojson",
               "--output", root / "m.csv", "--window", 128) == 0
    r0, r1, c0, c1 = SQUARE
    stride = 8                                          # 4 px at level 1 (1.0 µm/px, the checkpoint's) = 8 at level 0
    with openslide.OpenSlide(str(root / "m.tif")) as tif:
        mpp = float(tif.properties["openslide.mpp-x"])
        width, height = tif.level_dimensions[0]
    assert mpp == pytest.approx(4.0)                    # one map pixel per cell: 4 px of 1.0 µm
    assert abs(width * mpp - 400 * 0.5) < stride * 0.5 and abs(height * mpp - 320 * 0.5) < stride * 0.5
    bright_pixels = tifffile.imread(root / "m.tif")[..., 1] > 127          # sample 1: P(bright) x 255
    ys, xs = np.nonzero(bright_pixels)
    cell = mpp / 0.5                                    # level-0 pixels per map pixel
    assert abs(ys.min() * cell - r0) <= stride and abs((ys.max() + 1) * cell - r1) <= stride
    assert abs(xs.min() * cell - c0) <= stride and abs((xs.max() + 1) * cell - c1) <= stride
    features = json.loads((root / "m.geojson").read_text())
    assert features["type"] == "FeatureCollection"
    found = [f for f in features["features"] if f["properties"]["classification"]["name"] == "bright"]
    assert len(found) == 1 and "Mean P(bright)" in found[0]["properties"]["measurements"]
    outer = np.array(found[0]["geometry"]["coordinates"][0])
    assert np.abs(outer.min(axis=0) - (c0, r0)).max() <= stride and np.abs(outer.max(axis=0) - (c1, r1)).max() <= stride
    with open(root / "m.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert set(rows[0]) == {"x", "y", "class", "p_dark", "p_bright"}
    hot = np.array([(float(r["x"]), float(r["y"])) for r in rows if r["class"] == "bright"])
    assert c0 - stride <= hot[:, 0].min() and hot[:, 0].max() <= c1 + stride
    assert r0 - stride <= hot[:, 1].min() and hot[:, 1].max() <= r1 + stride


def test_resolution_follows_the_checkpoint_and_resampling_stays_exact(bright, tmp_path):
    root, checkpoint, _ = bright
    slide = square_slide(tmp_path / "s.tif", 200, 240, SQUARE, mpp=0.4)   # level 1: 0.8 µm/px, resampled to 1.0
    summary = infer_slide(checkpoint, slide, tmp_path / "r.npy", window=96, dtype="float64")
    assert (summary["level"], summary["scale"], summary["mpp"]) == (1, pytest.approx(1.25), pytest.approx(1.0))
    assert relative_difference(np.load(tmp_path / "r.npy"), whole_reference(checkpoint, slide)) <= 1e-9
    summary = infer_slide(checkpoint, slide, tmp_path / "f.npy", window=128, mpp=0.8)
    assert (summary["level"], summary["scale"]) == (1, 1.0)                   # --mpp: another resolution on purpose


def test_a_slide_without_resolution_is_refused_naming_the_flag(bright, tmp_path, capsys):
    root, checkpoint, _ = bright
    bare = square_slide(tmp_path / "bare.tif", 160, 160, (0, 32, 0, 32))
    assert cli("--checkpoint", checkpoint, "--slide", bare, "--output", tmp_path / "o.npy") == 2
    assert "--source-mpp: " in capsys.readouterr().err                       # "... carries no resolution; pass"
    assert cli("--checkpoint", checkpoint, "--slide", bare, "--output", tmp_path / "o.npy", "--source-mpp", 1.0,
               "--window", 160) == 0
    capsys.readouterr()
    scanned = square_slide(tmp_path / "scanned.tif", 160, 160, (0, 32, 0, 32), mpp=0.5)
    assert cli("--checkpoint", checkpoint, "--slide", scanned, "--output", tmp_path / "l.npy", "--slide-level",
               0) == 2
    assert "trained at 1 µm/px" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--mpp: .* would invent detail"):
        infer_slide(checkpoint, scanned, tmp_path / "x.npy", mpp=0.25)


def test_segmentation_gives_probabilities_label_map_and_polygons(unet):
    import openslide

    root, checkpoint, slide = unet
    summary = infer_slide(checkpoint, slide, [str(root / n) for n in ("m.npy", "m.tif", "m.geojson", "m.png")],
                          window=128, dtype="float64")
    assert summary["task"] == "segmentation" and summary["classes"] == ["background", "tumor", "stroma"]
    assert relative_difference(np.load(root / "m.npy"), whole_reference(checkpoint, slide)) <= 1e-9
    with openslide.OpenSlide(str(root / "m.tif")) as labels:
        assert labels.level_dimensions[0] == (200, 150) and float(labels.properties["openslide.mpp-x"]) == 0.5
    import tifffile

    label_map = tifffile.imread(root / "m.tif")
    probabilities = np.load(root / "m.npy")[:, :150, :200]
    assert np.array_equal(label_map, np.argmax(probabilities, axis=0))
    features = json.loads((root / "m.geojson").read_text())["features"]
    assert features and {f["properties"]["classification"]["name"] for f in features} <= set(summary["classes"])
    area = {}
    for f in features:
        name = f["properties"]["classification"]["name"]
        area[name] = area.get(name, 0.0) + f["properties"]["measurements"]["Area px^2"]
    for index, name in enumerate(summary["classes"]):
        assert area.get(name, 0.0) == pytest.approx(float((label_map == index).sum()))   # polygons tile the map
    assert summary["class_area_px"] == pytest.approx({n: float((label_map == i).sum())
                                                      for i, n in enumerate(summary["classes"])})


def test_min_area_and_excluded_classes(unet, tmp_path):
    root, checkpoint, slide = unet
    summary = infer_slide(checkpoint, slide, tmp_path / "small.geojson", window=160, min_area=40,
                          exclude_classes=("background",))
    features = json.loads((tmp_path / "small.geojson").read_text())["features"]
    assert all(f["properties"]["classification"]["name"] != "background" for f in features)
    assert all(f["properties"]["measurements"]["Area px^2"] >= 40 for f in features)
    assert summary["regions"]["background"] == 0


def test_a_checkpoint_of_the_other_task_is_refused_before_work(unet, bright, tmp_path, capsys):
    root, checkpoint, slide = unet
    assert cli("--checkpoint", checkpoint, "--slide", slide, "--output", tmp_path / "o.npy", "--task",
               "classification") == 2
    assert "holds a dense network (one prediction per pixel), not a classification network" in capsys.readouterr().err
    assert cli("--checkpoint", bright[1], "--slide", bright[2], "--output", tmp_path / "o.npy", "--task",
               "segmentation") == 2
    assert "holds a classifier" in capsys.readouterr().err
    assert cli("--checkpoint", checkpoint, "--slide", slide, "--output", tmp_path / "o.csv") == 2
    assert "one row per output cell, here per pixel" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_network_normalising_over_the_whole_image_is_refused(tmp_path):
    from mpi4dl_nb.infer.trained import check_streamable
    from mpi4dl_nb.models.spec import ModelSpec

    layers = ModelSpec.of("unet", num_layers=2, num_filters=8, num_classes=2, norm="group").build(32)
    with pytest.raises(ConfigError, match=r"GroupNorm\) normalises over the whole image.*train with BatchNorm"):
        check_streamable(layers)


def test_memory_of_a_segmentation_network_does_not_grow_with_the_slide(unet, tmp_path):
    """The window loop and the writers of the .npy, the label map and the overlay: flat. (A .geojson holds the
    holes of a region until its outer ring closes: its memory follows the regions' geometry, see docs.)"""
    root, checkpoint, _ = unet
    small = write_slide(tmp_path / "small.tif", tissue_image(192, 224), mpp=0.5)
    large = write_slide(tmp_path / "large.tif", tissue_image(576, 448), mpp=0.5)     # 6x the pixels
    peaks = {}
    for name, slide in (("warm-up", small), ("s", small), ("l", large)):
        outputs = [str(tmp_path / f"{name}.{kind}") for kind in ("npy", "tif", "png")]
        peaks[name] = infer_slide(checkpoint, slide, outputs, window=160, overwrite=True)["peak_memory_bytes"][0]
    assert peaks["l"] <= 1.3 * peaks["s"], f"{peaks['s']} -> {peaks['l']} bytes on a 6x larger slide"


def test_a_cohort_writes_every_good_slide_names_the_broken_one_and_resumes(unet, tmp_path, capsys):
    root, checkpoint, _ = unet
    slides = tmp_path / "slides"
    slides.mkdir()
    write_slide(slides / "a.tif", tissue_image(96, 128), mpp=0.5)
    (slides / "b.tif").write_bytes(b"II*\x00 not a slide")
    write_slide(slides / "c.tif", tissue_image(128, 96), mpp=0.5)
    out = tmp_path / "out"
    out.mkdir()
    argv = ["--checkpoint", checkpoint, "--slides", slides, "--output", out / "{slide}.npy", "--output",
            out / "{slide}.geojson", "--window", 128]
    assert cli(*argv) == 3
    captured = capsys.readouterr()
    assert "1 of 3 slides failed: b.tif" in captured.err and "[slide 3/3] c.tif: done" in captured.err
    assert sorted(p.name for p in out.iterdir()) == ["a.geojson", "a.npy", "c.geojson", "c.npy", "summary.csv"]
    with open(out / "summary.csv") as handle:
        table = {row["slide"]: row for row in csv.DictReader(handle)}
    assert table["a.tif"]["status"] == "done" and table["b.tif"]["status"] == "failed"
    assert float(table["a.tif"]["megapixels_per_s"]) > 0 and "area mm2 (tumor)" in table["a.tif"]
    assert "cannot be opened" in table["b.tif"]["message"]
    (slides / "b.tif").unlink()
    assert cli(*argv, "--resume-outputs") == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {
        "slides": 2, "done": 0, "skipped": 2, "failed": [], "summary": str(out / "summary.csv")}
    assert cli(*argv) == 2                                   # outputs there, no --resume-outputs: refused before work
    assert "exists; pass --overwrite" in capsys.readouterr().err


def test_train_at_an_mpp_records_it_and_infer_uses_it(tmp_path, capsys):
    from tests.support.infer_data import make_checkpoint

    scanned = write_slide(tmp_path / "scanned.tif", tissue_image(256, 256), mpp=0.5)
    flags = ["--datapath", str(scanned), "--mpp", "1.0", "--min-tissue", "0", "--steps", "1", "--num-classes", "1"]
    make_checkpoint(tmp_path / "ck", *flags)
    from mpi4dl_nb.checkpoint.files import latest_checkpoint
    from mpi4dl_nb.checkpoint.record import read_checkpoint

    assert read_checkpoint(latest_checkpoint(tmp_path / "ck")).record.data.mpp == pytest.approx(1.0)
    summary = infer_slide(tmp_path / "ck", scanned, tmp_path / "o.npy", window=160)
    assert (summary["level"], summary["scale"], summary["mpp"]) == (1, 1.0, pytest.approx(1.0))
    bare = write_slide(tmp_path / "bare.tif", tissue_image(256, 256))
    from mpi4dl_nb.cli.train_cmd import main as train_main
    from tests.support.infer_data import TRAIN_FLAGS

    with pytest.raises(SystemExit) as stopped:        # refused before the first step
        train_main([*TRAIN_FLAGS, *flags[:1], str(bare), *flags[2:], "--checkpoint-dir", str(tmp_path / "no")])
    assert stopped.value.code == 2 and "--source-mpp" in capsys.readouterr().err
