"""Slide-level inference of whole-slide models (``infer --slides/--cohort --output DIR``, infer/whole_slide.py,
slide_level.py, slide_outputs.py, attention_map.py): slides.csv, the slide-aligned map OME-TIFF and its GeoJSON, the
map on a slide built for it, refusals; 4 ranks equal one process in tests/mpi/whole_slide_infer.py.

The structure detector (tests/support/whole_slide_model.py) is set by hand, not trained: its trunk passes each cell's
darkness and its attention net scores darkness above that of nuclei, so on the synthetic slides of
data/synthetic_cohort.py it looks at the dark structures, and only there."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch

from mpi4dl_nb.cli import infer_cmd
from mpi4dl_nb.data.canvas import CanvasPlacement
from mpi4dl_nb.data.synthetic_cohort import write_synthetic_cohort
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.infer.attention_map import (
    attention_weights,
    canvas_positions,
    first_maxima,
    max_shares,
    on_slide,
    top_threshold,
)
from mpi4dl_nb.infer.outputs.slide_level import SLIDES_CSV, map_paths, read_slide_map
from mpi4dl_nb.infer.slide_list import list_slides
from mpi4dl_nb.infer.whole_slide import load_whole_slide
from tests.mpi.whole_slide_infer import CASES, ENCODED, label_of
from tests.support.battery import shared_job
from tests.support.infer_data import make_checkpoint
from tests.support.whole_slide_model import structure_detector

pytest.importorskip("openslide")
JOB = shared_job(4, "whole_slide_infer", timeout=120)
MPP, SIZE, STRIDE = 0.5, 256, 4          # the detector's canvas: 256 px at 0.5 µm/px, trunk stride 4 (2 µm cells)


@pytest.fixture(scope="module")
def cohort(tmp_path_factory):
    """Two 128 µm slides at 0.5 µm/px (256 px): slide-00 negative, slide-01 positive with its structures."""
    return write_synthetic_cohort(tmp_path_factory.mktemp("cohort"), slides=2, side_um=128.0, mpp=MPP, levels=3)


@pytest.fixture(scope="module")
def attention_run(cohort, tmp_path_factory):
    """``infer --cohort cohort.csv --output DIR`` with the attention detector, one process, float64."""
    manifest, _ = cohort
    root = tmp_path_factory.mktemp("attention")
    checkpoint = structure_detector(root / "c", "attention", SIZE, MPP)
    code = infer_cmd.main(["--checkpoint", str(checkpoint), "--cohort", str(manifest), "--output", str(root / "out"),
                           "--dtype", "float64", "--no-progress"])
    assert code == 0
    return root / "out"


def rows_of(table):
    with open(table, newline="") as handle:
        return list(csv.DictReader(handle))


def test_two_slides_give_slides_csv_with_labels_patients_and_probabilities(attention_run, cohort):
    _, slides = cohort
    rows = rows_of(attention_run / SLIDES_CSV)
    assert [r["slide"] for r in rows] == ["slide-00", "slide-01"]
    assert list(rows[0]) == ["slide", "patient", "label", "predicted", "prob_negative", "prob_positive"]
    for row, slide in zip(rows, slides):
        assert row["label"] == slide.label and row["patient"] == slide.patient
        assert row["predicted"] == slide.label          # the detector tells them apart
        assert abs(float(row["prob_negative"]) + float(row["prob_positive"]) - 1.0) < 1e-12
    assert float(rows[1]["prob_positive"]) > 0.99 > float(rows[0]["prob_positive"])


def test_the_attention_tiff_is_slide_aligned_with_mpp_within_one_stride(attention_run, cohort):
    import tifffile

    _, slides = cohort
    for slide in slides:
        tiff, _ = map_paths(attention_run, slide.path.stem, "attention")
        stored = read_slide_map(tiff)
        with tifffile.TiffFile(tiff) as tif:
            page = tif.pages[0]
            numerator, denominator = page.tags["XResolution"].value
            level0 = tif.series[0].levels[0].shape
        with tifffile.TiffFile(slide.path) as source:
            height, width = source.pages[0].shape[:2]
        map_mpp = 1e4 * denominator / numerator                    # pixels per cm -> µm per pixel
        assert stored.names == ("attention",) and stored.mpp == pytest.approx(MPP * STRIDE)
        assert map_mpp == pytest.approx(MPP * STRIDE, rel=1e-6)
        assert level0[-2:] == stored.values.shape[1:]
        rows, cols = stored.values.shape[1:]
        assert abs(rows * map_mpp - height * MPP) < STRIDE * MPP and abs(cols * map_mpp - width * MPP) < STRIDE * MPP
        weights = stored.values[0]
        assert 0.0 < np.nansum(weights) <= 1.0 + 1e-6     # the canvas's weights on the slide (beyond its edge: none)


def test_the_highest_attention_cells_fall_on_the_structures(attention_run, cohort):
    _, slides = cohort
    positive = slides[1]
    assert positive.label == "positive" and positive.structures
    tiff, geojson = map_paths(attention_run, positive.path.stem, "attention")
    weights = read_slide_map(tiff).values[0]
    centres = np.array(positive.structures, dtype=np.float64)        # (row, column), level-0 px = read px here
    top = np.argsort(np.nan_to_num(weights, nan=-1.0).ravel())[::-1][:5]
    for cell in top:
        row, col = divmod(int(cell), weights.shape[1])
        box_centre = np.array([(row + 0.5) * STRIDE, (col + 0.5) * STRIDE])
        nearest = float(np.abs(centres - box_centre).max(axis=1).min())
        assert nearest <= 2 * STRIDE, (row, col, nearest)             # a structure dot within two cells
    regions = json.loads(geojson.read_text())["features"]
    assert regions and all(f["properties"]["classification"]["name"] == "attention" for f in regions)
    for feature in regions:
        ring = np.array(feature["geometry"]["coordinates"][0])         # x, y level-0 px
        x0, y0 = ring.min(axis=0) - STRIDE
        x1, y1 = ring.max(axis=0) + STRIDE
        inside = (centres[:, 1] >= x0) & (centres[:, 1] <= x1) & (centres[:, 0] >= y0) & (centres[:, 0] <= y1)
        assert inside.any(), ring
        assert feature["properties"]["measurements"]["Mean P(attention)"] > 0
    negative = slides[0]
    share = read_slide_map(map_paths(attention_run, negative.path.stem, "attention")[0]).values[0]
    assert np.nanmax(share) < 0.5 * np.nanmax(weights)      # a slide without structures: no peak like them


def test_a_max_head_maps_the_channel_maxima_onto_the_structures(cohort, tmp_path):
    _, slides = cohort
    checkpoint = structure_detector(tmp_path / "c", "max", SIZE, MPP)
    listed = ",".join(str(s.path) for s in slides)
    assert infer_cmd.main(["--checkpoint", str(checkpoint), "--slides", listed, "--output", str(tmp_path / "out"),
                           "--dtype", "float64", "--no-progress"]) == 0
    rows = rows_of(tmp_path / "out" / SLIDES_CSV)
    assert [r["predicted"] for r in rows] == ["negative", "positive"] and not rows[0]["label"]
    shares = read_slide_map(map_paths(tmp_path / "out", "slide-01", "max share")[0]).values[0]
    assert np.nansum(shares) == pytest.approx(1.0)
    row, col = np.unravel_index(np.nanargmax(shares), shares.shape)
    centres = np.array(slides[1].structures, dtype=np.float64)
    centre = np.array([(row + 0.5) * STRIDE, (col + 0.5) * STRIDE])
    assert float(np.abs(centres - centre).max(axis=1).min()) <= 2 * STRIDE


def test_the_viewer_opens_the_attention_map_as_an_overlay(attention_run, cohort):
    from mpi4dl_nb.notebook.widgets.slide_viewer import SlideViewer

    _, slides = cohort
    tiff, geojson = map_paths(attention_run, "slide-01", "attention")
    viewer = SlideViewer.from_map(slides[1].path, tiff, polygons=geojson)
    stored = read_slide_map(tiff).values
    assert viewer.classes == ["attention"] and viewer.stride == pytest.approx(STRIDE)
    assert viewer.probs.shape == stored.shape and np.nanmax(viewer.probs) == pytest.approx(1.0)
    peak = np.unravel_index(np.nanargmax(stored[0]), stored.shape[1:])
    assert viewer.select((peak[1] + 0.5) * STRIDE, (peak[0] + 0.5) * STRIDE) == tuple(int(v) for v in peak)
    assert "attention: 1.000" in viewer.info.value
    assert viewer.show_polygons.value and viewer.regions
    renders = viewer.view.renders
    viewer.opacity.value = 0.9
    assert viewer.view.renders == renders + 1


# ------------------------------------------------------------------------------------------------ refusals
def test_window_flags_several_outputs_and_a_file_as_output_are_refused(cohort, tmp_path, capsys):
    manifest, _ = cohort
    checkpoint = structure_detector(tmp_path / "c", "attention", SIZE, MPP)
    base = ["--checkpoint", str(checkpoint), "--cohort", str(manifest)]
    (tmp_path / "file").write_text("")
    for extra, fragment in ((["--output", str(tmp_path / "o"), "--window", "64"], "--window: not for a whole-slide"),
                            (["--output", str(tmp_path / "a"), "--output", str(tmp_path / "b")], "--output DIR once"),
                            (["--output", str(tmp_path / "file")], "is a file")):
        assert infer_cmd.main([*base, *extra]) == infer_cmd.EXIT_SETUP
        assert fragment in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_an_existing_slides_csv_needs_overwrite(attention_run, cohort, capsys):
    manifest, _ = cohort
    checkpoint = attention_run.parent / "c"
    argv = ["--checkpoint", str(checkpoint), "--cohort", str(manifest), "--output", str(attention_run),
            "--dtype", "float64", "--no-progress"]
    assert infer_cmd.main(argv) == infer_cmd.EXIT_SETUP
    assert "pass --overwrite" in capsys.readouterr().err
    assert infer_cmd.main([*argv, "--overwrite"]) == 0


def test_a_grid_that_does_not_divide_the_canvas_is_refused(tmp_path):
    from mpi4dl_nb.infer.whole_slide import CanvasNetwork
    from mpi4dl_nb.spatial.geometry import TileGrid

    class ThreeRanks:
        rank, world_size, device = 0, 3, torch.device("cpu")

    model = load_whole_slide(structure_detector(tmp_path / "c", "attention", 100, MPP), torch.float64)
    with pytest.raises(ConfigError) as err:
        CanvasNetwork(model, TileGrid.from_slice_method("vertical", 3), ThreeRanks(), torch.float64)  # type: ignore[arg-type]
    assert err.value.knob == "--num-spatial-parts" and "divides it" in str(err.value)


def test_a_tile_model_is_not_a_whole_slide_model(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "tiles")
    with pytest.raises(ConfigError) as err:
        load_whole_slide(checkpoint, torch.float64)
    assert err.value.knob == "--checkpoint" and "--whole-slide" in str(err.value)


def test_slides_can_be_listed_with_commas(cohort, tmp_path):
    _, slides = cohort
    assert list_slides(",".join(str(s.path) for s in slides)) == [s.path for s in slides]
    with pytest.raises(ConfigError, match="no such slide file"):
        list_slides(f"{slides[0].path},{tmp_path / 'gone.tif'}")


# ------------------------------------------------------------------------------------------------ the maps
def test_first_maxima_break_ties_by_the_first_position_of_the_whole_canvas():
    values = np.array([[1.0, 5.0], [3.0, 5.0]])            # two tiles, two channels: channel 1 tied
    positions = np.array([[7, 40], [12, 9]])
    assert first_maxima(values, positions).tolist() == [12, 9]
    assert canvas_positions(np.array([0, 5]), (2, 4, 4, 8), 8).tolist() == [20, 29]   # tile 4 wide at row 2, col 4
    shares = max_shares(np.array([3, 3, 0]), np.array([True, True, False]), (2, 2))
    assert shares.tolist() == [[0.0, 0.0], [0.0, 1.0]]     # the constant channel (at 0) left out


def test_attention_weights_and_the_region_threshold():
    scores = torch.tensor([[0.0, 30.0], [0.0, 0.0]], dtype=torch.float64)
    weights = attention_weights(scores)
    assert weights.sum() == pytest.approx(1.0) and weights[0, 1] == pytest.approx(1.0)
    assert top_threshold(weights) == weights[0, 1]             # the peak, not the near-zero percentile
    flat = np.full((10, 10), 0.01)
    assert top_threshold(flat) == pytest.approx(0.01)
    assert top_threshold(np.full((2, 2), np.nan)) == float("inf")


def test_a_canvas_map_lands_on_the_slide_at_its_corner_in_strides():
    placement = CanvasPlacement("s", top=-8, left=5, size=32, extent=(40, 20), tissue=(0, 20, 0, 40),
                                tissue_share=0.5, cut_share=0.0)
    cells = np.arange(64, dtype=np.float64).reshape(8, 8)      # stride 4; the corner 1.25 strides right: map pixel 1
    placed = on_slide(cells, placement)
    assert placed.values.shape == (5, 10) and placed.offset == (-2, 1) and placed.stride == 4
    assert placed.values[0, 1] == cells[2, 0] and placed.values[4, 8] == cells[6, 7]
    assert np.isnan(placed.values[:, 0]).all() and np.isnan(placed.values[:, 9]).all()
    assert np.isfinite(placed.values[:, 1:9]).all()         # rows above the slide and beyond it dropped


def test_the_four_rank_inference_equals_one_process(shared_launch):
    names = [f"{label_of(case)}: {what}" for case in CASES for what in ("each rank reads its tile",
                                                                         "probabilities equal one process",
                                                                         "map equals one process")]
    names += [f"{ENCODED}: class attention equals one process"]
    shared_launch(JOB).require_clean(names)


def test_a_tile_map_of_a_slide_level_pool_is_refused_naming_slide_level_inference():
    from mpi4dl_nb.infer.fully_conv import fully_convolutional
    from tests.support.whole_slide_model import spec_of

    with pytest.raises(ConfigError) as err:
        fully_convolutional(spec_of("max").build(32), 32)
    assert err.value.knob == "--checkpoint" and "infer --slides A,B --output DIR" in str(err.value)


def test_a_slide_without_tissue_is_reported_and_the_others_go_on(cohort, tmp_path, capsys):
    from mpi4dl_nb.data.slide_writer import write_slide
    from mpi4dl_nb.data.synthetic_cohort import GLASS

    _, slides = cohort
    blank = write_slide(tmp_path / "blank.tif", np.full((256, 256, 3), GLASS, np.uint8), mpp=MPP)
    checkpoint = structure_detector(tmp_path / "c", "max", SIZE, MPP)
    argv = ["--checkpoint", str(checkpoint), "--slides", f"{blank},{slides[1].path}", "--output",
            str(tmp_path / "out"), "--dtype", "float64", "--no-progress"]
    assert infer_cmd.main(argv) == infer_cmd.EXIT_SLIDES_FAILED
    captured = capsys.readouterr()
    assert "blank.tif: FAILED, skipped" in captured.err and "shows no tissue" in captured.err
    assert "1 of 2 slides failed: blank" in captured.err
    assert [r["slide"] for r in rows_of(tmp_path / "out" / SLIDES_CSV)] == ["slide-01"]


def test_a_checkpoint_of_train_whole_slide_runs_end_to_end(cohort, tmp_path, capsys):
    """A real ``train --whole-slide`` checkpoint (one process, --pool avg: the slide-level pools need spatial ranks
    in training) through ``infer --slide``: slides.csv from the record's canvas size and MPP, no map for avg."""
    from mpi4dl_nb.cli import train_cmd

    manifest, slides = cohort
    flags = ["--whole-slide", "--cohort", str(manifest), "--image-size", "64", "--mpp", "2", "--model", "resnet",
             "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4", "--batch-size", "1",
             "--split-size", "1", "--spatial-size", "0", "--no-progress", "--steps", "1", "--dtype", "float64",
             "--checkpoint-dir", str(tmp_path / "c")]
    assert train_cmd.main(flags) == 0
    capsys.readouterr()
    assert infer_cmd.main(["--checkpoint", str(tmp_path / "c"), "--slide", str(slides[0].path), "--output",
                           str(tmp_path / "out"), "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "on 1x1 tiles of its 64 px canvas" in out.err
    rows = rows_of(tmp_path / "out" / SLIDES_CSV)
    assert [r["slide"] for r in rows] == ["slide-00"] and rows[0]["predicted"] in ("negative", "positive")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [SLIDES_CSV]
    assert json.loads(out.out.strip().splitlines()[-1])["done"] == 1


def test_a_tissue_mean_head_reads_its_tissue_channel_and_gives_probabilities_only(cohort, tmp_path):
    """One process against the network on the whole canvas with its tissue mask (4 channels), float64."""
    from mpi4dl_nb.infer.slide_level import open_canvas
    from mpi4dl_nb.infer.slide_list import slide_sources
    from tests.mpi.whole_slide_infer import reference
    from tests.support.whole_slide_model import random_whole_slide

    manifest, _ = cohort
    checkpoint = random_whole_slide(tmp_path / "c", "tissue-mean", 64, 2.0)
    assert infer_cmd.main(["--checkpoint", str(checkpoint), "--cohort", str(manifest), "--output",
                           str(tmp_path / "out"), "--dtype", "float64", "--no-progress"]) == 0
    model = load_whole_slide(checkpoint, torch.float64)
    written = {r["slide"]: [float(r["prob_negative"]), float(r["prob_positive"])]
               for r in rows_of(tmp_path / "out" / SLIDES_CSV)}
    for slide in slide_sources(str(manifest), model.classes):
        canvases = open_canvas(model, slide, 0, 2.0, None)
        assert canvases.channels == 4
        expected, looked = reference(model, canvases)
        canvases.close()
        assert looked is None and np.abs(np.array(written[slide.path.stem]) - expected).max() < 1e-12
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [SLIDES_CSV]


def test_slide_level_inference_from_python(cohort, tmp_path):
    from mpi4dl_nb.infer.api import infer_slides

    _, slides = cohort
    checkpoint = structure_detector(tmp_path / "c", "max", SIZE, MPP)
    summary = infer_slides(checkpoint, [s.path for s in slides], tmp_path / "out", dtype="float64")
    assert summary is not None and summary["done"] == 2 and not summary["failed"]
    assert [r["predicted"] for r in rows_of(summary["summary"])] == ["negative", "positive"]
    assert map_paths(tmp_path / "out", "slide-01", "max share")[0].exists()


@pytest.mark.parametrize("pool", ["attention", "max"])
def test_a_torchvision_model_with_a_slide_pool_predicts_and_maps_as_one_forward(cohort, tmp_path, pool):
    """``--model torchvision:resnet18 --pool attention|max`` (models/named_pool.py): slide-level inference finds the
    pool inside the model's last piece; probabilities and map equal the network on the whole canvas (float64)."""
    pytest.importorskip("torchvision")
    from mpi4dl_nb.infer.slide_level import open_canvas
    from mpi4dl_nb.infer.slide_list import slide_sources
    from mpi4dl_nb.models.spec import ModelSpec
    from tests.mpi.whole_slide_infer import reference
    from tests.support.whole_slide_model import write_whole_slide

    spec = ModelSpec.of("torchvision:resnet18", num_classes=2, pool=pool)
    torch.manual_seed(0)
    layers = [layer.double().eval() for layer in spec.build(64)]
    checkpoint = write_whole_slide(tmp_path / "c", layers, spec, 64, 2.0)
    manifest, _ = cohort
    assert infer_cmd.main(["--checkpoint", str(checkpoint), "--cohort", str(manifest), "--output",
                           str(tmp_path / "out"), "--dtype", "float64", "--no-progress"]) == 0
    model = load_whole_slide(checkpoint, torch.float64)
    assert model.pool_module is not None
    written = {r["slide"]: [float(r["prob_negative"]), float(r["prob_positive"])]
               for r in rows_of(tmp_path / "out" / SLIDES_CSV)}
    label = "attention" if pool == "attention" else "max share"
    for slide in slide_sources(str(manifest), model.classes):
        canvases = open_canvas(model, slide, 0, 2.0, None)
        expected, looked = reference(model, canvases)
        canvases.close()
        assert np.abs(np.array(written[slide.path.stem]) - expected).max() < 1e-12
        assert looked is not None and looked.shape == (2, 2)
        mapped = read_slide_map(map_paths(tmp_path / "out", slide.path.stem, label)[0]).values[0]
        values = np.sort(mapped[np.isfinite(mapped)])           # the 2x2 cells on the slide, float32
        assert values.shape == (4,) and np.abs(values - np.sort(looked.ravel())).max() < 1e-6


def test_a_slide_encoder_s_class_attention_is_written_slide_aligned(cohort, tmp_path):
    """``--slide-encoder transformer``: the class token's attention over the cells (last block, mean over heads) as
    a slide-aligned OME-TIFF beside the attention pool's map, one process, float64; its values the attention
    recomputed from the last block's input (float32 in the file)."""
    import tifffile

    from mpi4dl_nb.infer.attention_map import CLASS_MAP_NAME
    from mpi4dl_nb.infer.slide_level import open_canvas
    from mpi4dl_nb.models.slide_encoder import SlideEncoderSpec
    from tests.mpi.whole_slide_infer import class_reference
    from tests.support.whole_slide_model import random_whole_slide

    manifest, slides = cohort
    checkpoint = random_whole_slide(tmp_path / "c", "attention", SIZE, MPP, encoder=SlideEncoderSpec(2, 2))
    model = load_whole_slide(checkpoint, torch.float64)
    assert infer_cmd.main(["--checkpoint", str(checkpoint), "--cohort", str(manifest), "--output",
                           str(tmp_path / "out"), "--dtype", "float64", "--no-progress"]) == 0
    for slide in slides:
        tiff, geojson = map_paths(tmp_path / "out", slide.path.stem, CLASS_MAP_NAME)
        assert tiff.name == f"{slide.path.stem}.class-attention.ome.tif" and geojson.exists()
        assert map_paths(tmp_path / "out", slide.path.stem, "attention")[0].exists()     # the pool's map too
        stored = read_slide_map(tiff)
        with tifffile.TiffFile(slide.path) as source:
            height, width = source.pages[0].shape[:2]
        rows, cols = stored.values.shape[1:]
        assert stored.names == (CLASS_MAP_NAME,) and stored.mpp == pytest.approx(MPP * STRIDE)
        assert abs(rows * MPP * STRIDE - height * MPP) < STRIDE * MPP
        assert abs(cols * MPP * STRIDE - width * MPP) < STRIDE * MPP
        weights = stored.values[0]
        assert 0 < np.isfinite(weights).sum() <= (SIZE // STRIDE) ** 2   # the canvas's cells that lie on the slide
        assert 0.0 < np.nansum(weights) < 1.0       # the class token's attention to the cells (not to itself)
        canvases = open_canvas(model, slide, 0, MPP, None)
        wanted = on_slide(class_reference(model, canvases), canvases.placements[0]).values
        canvases.close()
        assert (np.isnan(wanted) == np.isnan(weights)).all()
        assert np.nanmax(np.abs(wanted - weights)) < 1e-6


def test_a_vit_trunk_s_slide_encoder_predicts_and_maps_its_patch_tokens(cohort, tmp_path):
    """``--model NAME --slide-encoder transformer --pool attention`` with a small ViT-Ti/16 (models/token_grid.py):
    the ViT's 4x4 patch tokens (its class and register tokens dropped) are the canvas's cells; probabilities, the
    pool's map and the class token's attention written slide-aligned at the patch stride equal the network on the
    whole canvas. 4 ranks: tests/mpi/whole_slide_cli.py."""
    pytest.importorskip("timm")
    from mpi4dl_nb.infer.attention_map import CLASS_MAP_NAME
    from mpi4dl_nb.infer.slide_level import open_canvas
    from mpi4dl_nb.infer.slide_list import slide_sources
    from mpi4dl_nb.models.slide_encoder import SlideEncoderSpec
    from mpi4dl_nb.models.spec import ModelSpec
    from tests.mpi.whole_slide_infer import class_reference, reference
    from tests.support.whole_slide_model import write_whole_slide

    spec = ModelSpec.of("tests.mpi.whole_slide_cli:small_vit", num_classes=2, pool="attention",
                        slide_encoder=SlideEncoderSpec(1, 4), image_size=64)      # as train records it
    torch.manual_seed(0)
    layers = [layer.double().eval() for layer in spec.build()]
    checkpoint = write_whole_slide(tmp_path / "c", layers, spec, 64, 2.0)
    manifest, _ = cohort
    assert infer_cmd.main(["--checkpoint", str(checkpoint), "--cohort", str(manifest), "--output",
                           str(tmp_path / "out"), "--dtype", "float64", "--no-progress"]) == 0
    model = load_whole_slide(checkpoint, torch.float64)
    assert model.encoder is not None and model.pool_module is not None and model.head_on_cells
    written = {r["slide"]: [float(r["prob_negative"]), float(r["prob_positive"])]
               for r in rows_of(tmp_path / "out" / SLIDES_CSV)}
    for slide in slide_sources(str(manifest), model.classes):
        canvases = open_canvas(model, slide, 0, 2.0, None)
        expected, looked = reference(model, canvases)
        attended = class_reference(model, canvases)
        placement = canvases.placements[0]
        canvases.close()
        assert np.abs(np.array(written[slide.path.stem]) - expected).max() < 1e-12
        assert looked is not None and attended is not None and looked.shape == attended.shape == (4, 4)
        for name, cells in (("attention", looked), (CLASS_MAP_NAME, attended)):
            stored = read_slide_map(map_paths(tmp_path / "out", slide.path.stem, name)[0])
            assert stored.mpp == pytest.approx(2.0 * 16)                     # one map pixel per 16 px patch
            wanted = on_slide(cells, placement).values
            assert (np.isnan(wanted) == np.isnan(stored.values[0])).all()
            assert np.nanmax(np.abs(wanted - stored.values[0])) < 1e-6       # float32 in the file
