"""Slide inference in one process: windows equal the whole-slide network, outputs, resume, tissue skip,
bounded memory and bad input (the command's code path, in this process)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from mpi4dl_nb.cli.infer_cmd import main as infer_main
from mpi4dl_nb.infer.api import infer_slide
from tests.support.infer_data import make_slide, relative_difference, whole_slide_reference


@pytest.fixture
def data(infer_data):
    return infer_data


def run(checkpoint, slide, outputs, **options):
    options.setdefault("window", 128)
    options.setdefault("dtype", "float64")
    return infer_slide(checkpoint, slide, [str(o) for o in outputs], **options)


def test_windows_equal_the_whole_slide_network(data):
    root, checkpoint, slide, reference = data
    summary = run(checkpoint, slide, [root / "a.npy"])
    assert summary["complete"] and summary["windows"] > 6 and summary["window_grid"][0] > 1
    result = np.load(root / "a.npy")
    assert result.dtype == np.float64 and relative_difference(result, reference) <= 1e-12
    assert not (root / "a.npy.partial.npy").exists() and not (root / "a.npy.partial.npy.json").exists()
    level1 = run(checkpoint, slide, [root / "c.npy"], level=1)
    assert relative_difference(np.load(root / "c.npy"), whole_slide_reference(checkpoint, slide, 1)) <= 1e-12
    assert level1["slide_size"] == [165, 75]


def test_tif_opens_in_openslide_with_the_pyramid_levels_and_png_overlay(data):
    import openslide
    import tifffile
    from PIL import Image

    root, checkpoint, slide, reference = data
    summary = run(checkpoint, slide, [root / "h.tif", root / "h.png", root / "v.tif:preview"], heat_class=1,
                  window=128, dtype="float32")
    shift = summary["map"]["cell_shift"]
    assert summary["map"]["map_shape"] == [38, 83] and shift == 4          # 150 x 330 px in strides of 4
    with openslide.OpenSlide(str(root / "h.tif")) as heat:
        assert heat.level_dimensions == ((83, 38),)                          # covers the slide's extent
        description = json.loads(heat.properties["tiff.ImageDescription"])
    assert description["kind"] == "probabilities" and description["classes"] == ["0", "1"]
    assert description["stride"] == 4 and description["cell_shift"] == shift
    probabilities = tifffile.imread(root / "h.tif")                          # one 8-bit sample per class
    rows, cols = reference.shape[1:]
    expected = np.rint(np.moveaxis(reference, 0, -1) * 255)
    assert probabilities.shape == (38, 83, 2) and probabilities.dtype == np.uint8
    placed = probabilities[shift:shift + rows, shift:shift + cols].astype(float)
    assert np.abs(placed - expected).max() <= 1                                   # cell j on map pixel j + shift
    placed[...] = 0
    assert (probabilities == 0).sum() >= probabilities.size - placed.size        # no cell elsewhere: no data
    from mpi4dl_nb.infer.outputs.colors import colorize, colormap_lut

    preview = tifffile.imread(root / "v.tif")
    assert tuple(preview[7 + shift, 5 + shift]) == tuple(colorize(np.array([reference[1, 7, 5]], dtype=np.float32),
                                                                  colormap_lut())[0])
    with Image.open(root / "h.png") as png:
        assert png.size == (330, 150 + 28) and png.mode == "RGB"            # the overview and its legend
    assert not (root / "h.tif.partial.npy").exists()


def test_resume_continues_from_the_last_finished_window_row(data, capsys):
    root, checkpoint, slide, reference = data
    first = run(checkpoint, slide, [root / "r.npy"], max_window_rows=1)
    assert not first["complete"] and 0 < first["rows_done"] < reference.shape[1]
    progress = json.loads((root / "r.npy.partial.npy.json").read_text())
    assert progress["rows_done"] == first["rows_done"] and not (root / "r.npy").exists()
    code = infer_main(["--checkpoint", str(checkpoint), "--slide", str(slide), "--output", str(root / "r.npy"),
                       "--dtype", "float32", "--window", "128", "--resume-outputs", "--no-progress"])
    assert code == 2 and "other dtype" in capsys.readouterr().err
    code = infer_main(["--checkpoint", str(checkpoint), "--slide", str(slide), "--output", str(root / "r.npy"),
                       "--no-progress", "--dtype", "float64", "--window", "128"])
    assert code == 2 and "pass --resume-outputs to continue it" in capsys.readouterr().err
    second = run(checkpoint, slide, [root / "r.npy"], resume_outputs=True, window=192)   # another window size is fine
    assert second["complete"] and second["first_row"] == first["rows_done"]
    assert relative_difference(np.load(root / "r.npy"), reference) <= 1e-12


def test_tissue_only_skips_background_windows(data, capsys):
    root, checkpoint, slide, reference = data
    capsys.readouterr()
    summary = run(checkpoint, slide, [root / "t.npy"], tissue_only=True, progress=True)
    lines = capsys.readouterr().err.splitlines()     # set-up lines, then infer/pace.PacedProgress: a line a window row
    bars = [text for text in lines if text.startswith("[")]
    assert all(text.startswith("mpi4dl_nb infer: ") for text in lines[:len(lines) - len(bars)]), lines
    rows = summary["window_grid"][0]
    line = r"\[[#.]{30}\] windows \d+/\d+ rows \d+/\d+ \d+\.\d\d MP/s ETA \d+:\d\d"
    assert len(bars) == rows and all(re.fullmatch(line, b) for b in bars), bars
    assert bars[-1].startswith(f"[{'#' * 30}] windows {summary['windows']}/{summary['windows']} rows {rows}/{rows} ")
    result = np.load(root / "t.npy")
    assert summary["skipped_background"] > 0
    assert summary["computed_windows"] + summary["skipped_background"] == summary["windows"]
    computed = ~np.isnan(result)
    assert not computed.all() and computed[:, :, :40].all()          # the glass is the right third
    assert relative_difference(result[computed], reference[computed]) <= 1e-12   # float64: as the whole slide


def test_command_summary_line(data, capsys):
    root, checkpoint, slide, _ = data
    step_file = next(checkpoint.glob("step-00000002*.pt"))    # a file, not the directory
    assert infer_main(["--checkpoint", str(step_file), "--slide", str(slide), "--output",
                       str(root / "cli.npy"), "--window", "128", "--no-progress", "--device", "cpu"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("megapixels_per_s", "peak_memory_bytes", "windows", "skipped_background"):
        assert key in summary
    assert summary["megapixels_per_s"] > 0 and len(summary["peak_memory_bytes"]) == 1
    assert summary["field"]["cols"] == [12, 41] and summary["output_stride"] == 4


def test_memory_does_not_grow_with_slide_size(data):
    """At a fixed window the peak is the window's: the same on a slide 6x larger (classifier; the segmentation
    network's twin is in test_outputs.py). Samples are taken on the main thread only: the figure is repeatable."""
    root, checkpoint, _, _ = data
    small = make_slide(root / "small.tif", 320, 448)
    large = make_slide(root / "large.tif", 960, 896)      # 6x the pixels
    peaks = {}
    for name, slide in (("warm-up", small), ("s", small), ("l", large)):   # warm-up: kernel caches of the shape
        summary = run(checkpoint, slide, [root / f"m{name}.npy", root / f"m{name}.tif"], window=160,
                      overwrite=True)
        peaks[name] = summary["peak_memory_bytes"][0]
    assert summary["memory_source"] == "heap" and summary["windows"] >= 6 * 12
    assert peaks["l"] <= 1.3 * peaks["s"], f"peak per rank {peaks['s']} -> {peaks['l']} bytes on a 6x larger slide"


@pytest.mark.parametrize("flags, message", [
    (["--checkpoint", "{root}/missing"], "--checkpoint: '{root}/missing': no such checkpoint file or directory"),
    (["--model", "amoebanet"], "holds a resnet network, not amoebanet"),
    (["--slide", "{root}/not-a-slide.tif"], "cannot be opened as a slide or an image"),
    (["--slide-level", "7"], "--slide-level: {slide} has levels 0..2, not 7"),
    (["--checkpoint", "{root}/not-a-checkpoint.pt"], "cannot load checkpoint"),
    (["--output", "{root}/exists.npy"], "exists; pass --overwrite"),
    (["--window", "8", "--num-spatial-parts", "1"], "--window: 8 px per rank is too small"),
])
def test_bad_input_is_refused_clearly(data, capsys, flags, message):
    root, checkpoint, slide, _ = data
    (root / "not-a-slide.tif").write_text("hello")
    (root / "not-a-checkpoint.pt").write_text("hello")
    (root / "exists.npy").write_bytes(b"keep me")
    args = {"--checkpoint": str(checkpoint), "--slide": str(slide), "--output": str(root / "bad.npy")}
    extra = []
    for flag, value in zip(flags[::2], flags[1::2]):
        value = value.format(root=root)
        if flag in args:
            args[flag] = value
        else:
            extra += [flag, value]
    argv = [*(x for pair in args.items() for x in pair), *extra, "--no-progress"]
    assert infer_main(argv) == 2
    err = capsys.readouterr().err
    assert message.format(root=root, slide=slide) in err, err
    assert (root / "exists.npy").read_bytes() == b"keep me" and not (root / "bad.npy").exists()
