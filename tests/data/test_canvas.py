"""data/canvas.py and data/synthetic_cohort.py: a slide's tissue centred on one canvas, read box by box; whole-slide
training from slide labels (``train --whole-slide``: refusals, one process end to end; 5 ranks in
tests/mpi/whole_slide_cli.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mpi4dl_nb.checkpoint.record import DataRecord, read_checkpoint
from mpi4dl_nb.cli import evaluate_cmd
from mpi4dl_nb.cli import train_cmd as cli
from mpi4dl_nb.data.apps import AppKind
from mpi4dl_nb.data.canvas import CanvasPlacement, SlideCanvases, cohort_canvases, place_canvas
from mpi4dl_nb.data.groups import GroupKind, groups_of
from mpi4dl_nb.data.manifest import read_cohort
from mpi4dl_nb.data.synthetic_cohort import STRUCTURE, write_synthetic_cohort
from mpi4dl_nb.errors import ConfigError
from tests.mpi.whole_slide_cli import CASES, VIT_INFER, case_name, cli_case_name
from tests.support.battery import shared_job
from tests.support.infer_data import write_slide

pytest.importorskip("openslide")
JOB = shared_job(5, "whole_slide_cli", timeout=600)   # 32 s alone, 231-265 s in the two-stream suite here
SMALL = ("--model resnet --resnet-version 1 --num-layers 8 --num-filters 4 --batch-size 2 --split-size 1 "
         "--spatial-size 0 --no-progress").split()


@pytest.fixture(scope="module")
def cohort(tmp_path_factory):
    manifest, slides = write_synthetic_cohort(tmp_path_factory.mktemp("cohort"), slides=6, side_um=200.0, mpp=0.5)
    return manifest, slides


def test_the_canvas_centres_the_tissue_cuts_what_is_larger_and_pads_beyond_the_slide():
    mask = np.zeros((10, 20), dtype=bool)
    mask[2:6, 4:12] = True                                 # tissue rows 2..5, columns 4..11 of a coarse image
    small = place_canvas("s", mask, (200, 100), 100)       # slide 200x100 px as read: 10 px per coarse pixel
    assert small.tissue == (20, 60, 40, 120) and (small.top, small.left) == (-10, 30)   # starts above the slide
    assert small.cut_share == 0.0 and small.tissue_share == pytest.approx(40 * 80 / 100 ** 2)
    large = place_canvas("s", mask, (200, 100), 20)        # 20 px around the centre (40, 80)
    assert (large.top, large.left) == (30, 70)
    assert large.cut_share == pytest.approx(1 - 2 * 2 / 32)  # 2x2 of the 4x8 coarse tissue pixels inside
    assert small.source_box((0, 100, 0, 100)) == (-10, 90, 30, 130)
    with pytest.raises(ValueError, match="slide empty shows no tissue"):
        place_canvas("empty", np.zeros((4, 4), dtype=bool), (40, 40), 8)
    assert CanvasPlacement.from_dict(json.loads(json.dumps(small.to_dict()))) == small


def test_boxes_read_alone_equal_the_whole_canvas_at_any_resolution(cohort):
    manifest, _ = cohort
    found = read_cohort(manifest)
    for mpp, size in ((1.0, 160), (0.75, 300)):            # level 1 as stored; between levels 0 and 1 (resampled)
        canvases = cohort_canvases(found, size, mpp=mpp)
        for index in (0, 3):
            whole = canvases.read(index)
            assert whole.shape == (3, size, size)
            for box in ((0, 37, 0, size), (37, size, 0, 101), (37, size, 101, size)):   # uneven tiles
                assert torch.equal(canvases.read(index, box), whole[:, box[0]:box[1], box[2]:box[3]])
        beyond = canvases.placements[0]
        if beyond.top < 0:                                   # the canvas reaches above the slide: white there
            assert torch.all(canvases.read(0, (0, -beyond.top, 0, size)) == 1.0)
    masked = cohort_canvases(found, 300, mpp=0.75, tissue_channel=True)       # --pool tissue-mean's fourth channel
    whole = masked.read(1)
    assert masked.channels == 4 and whole.shape == (4, 300, 300) and set(whole[3].unique().tolist()) == {0.0, 1.0}
    assert torch.equal(masked.read(1, (37, 300, 101, 300)), whole[:, 37:, 101:])
    glass = whole[:3].amin(0) > 0.9                          # the mask is the coarse level's: edges are rough
    assert 0.1 < float(whole[3].mean()) < 0.9 and float(whole[3][glass].mean()) < 0.1 < float(whole[3][~glass].mean())


def test_canvases_are_grouped_by_patient_and_labelled_by_the_manifest(cohort):
    manifest, slides = cohort
    canvases = cohort_canvases(read_cohort(manifest), 64, mpp=2.0)
    groups = groups_of(canvases)
    assert groups.kind is GroupKind.PATIENT and list(groups.names) == [s.patient for s in slides]
    assert [canvases.classes[canvases.label(i)] for i in range(len(canvases))] == [s.label for s in slides]
    assert len(canvases.report()) == 6 and "on a 64 px canvas" in canvases.report()[0]


def test_structures_are_seen_at_fine_resolution_and_vanish_at_coarse(cohort):
    manifest, slides = cohort
    found = read_cohort(manifest)
    darkest = {}
    for mpp in (0.5, 4.0):
        canvases = cohort_canvases(found, int(160 / mpp), mpp=mpp)
        darkest[mpp] = [float(canvases.read(i).sum(0).min()) * 255 for i in range(len(canvases))]
    positive = [i for i, s in enumerate(slides) if s.label == "positive"]
    negative = [i for i, s in enumerate(slides) if s.label == "negative"]
    assert positive and negative and all(slides[i].structures for i in positive)
    fine = sum(STRUCTURE) + 30
    assert all(darkest[0.5][i] <= fine for i in positive) and all(darkest[0.5][i] > fine for i in negative)
    assert all(darkest[4.0][i] > fine for i in positive)  # averaged into the stroma at 4 µm per pixel


def test_a_slide_without_tissue_is_refused_naming_it(tmp_path):
    write_slide(tmp_path / "glass.tif", np.full((128, 128, 3), 240, dtype=np.uint8), mpp=0.5)
    with pytest.raises(ValueError, match="slide glass shows no tissue"):
        SlideCanvases([tmp_path / "glass.tif"], [0], ["a"], 64)


@pytest.mark.parametrize("extra, fragment", [
    ([], "needs slide labels: --cohort"),
    (["--task", "segmentation", "--model", "unet", "--app", "medical"], "learns slide labels"),
])
def test_whole_slide_without_slide_labels_is_refused(extra, fragment):
    args = cli.train_parser().parse_args(["--whole-slide", *extra])
    with pytest.raises(ConfigError) as err:
        cli.train_plan(args)
    assert err.value.knob == "--whole-slide" and fragment in str(err.value)


def test_whole_slide_on_a_slide_tiles_or_unlabelled_slides_is_refused(tmp_path, cohort):
    _, slides = cohort
    tiles = tmp_path / "tiles" / "a"
    tiles.mkdir(parents=True)
    for name in ("1.png", "2.png"):
        (tiles / name).write_bytes(b"")
    for datapath, fragment in ((slides[0].path, "is one slide"), (tmp_path / "tiles", "holds image tiles"),
                               (slides[0].path.parent, "slides directly in the folder")):
        args = cli.train_parser().parse_args(["--whole-slide", "--app", "medical", "--datapath", str(datapath)])
        with pytest.raises(ConfigError) as err:
            cli.train_plan(args)
        assert err.value.knob == "--whole-slide" and fragment in str(err.value)


def test_train_and_evaluate_whole_slides_from_a_cohort(cohort, tmp_path, capsys):
    manifest, _ = cohort
    flags = ["--whole-slide", "--cohort", str(manifest), "--image-size", "64", "--mpp", "2", *SMALL, "--steps", "2",
             "--val-fraction", "0.34", "--checkpoint-dir", str(tmp_path / "c")]
    assert cli.main(flags) == 0
    out = capsys.readouterr()
    assert "whole-slide canvases:" in out.err and "slide-05: tissue" in out.err
    summary = json.loads(out.out.strip().splitlines()[-1])
    record = read_checkpoint(summary["checkpoint"]).record
    assert record.data.whole_slide and len(record.data.canvases) == 6 and record.data.app is AppKind.MEDICAL
    assert DataRecord.from_dict(record.data.to_dict()) == record.data
    assert evaluate_cmd.main(["--checkpoint", str(tmp_path / "c"), "--split-size", "1", "--spatial-size", "0"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record.split is not None and figures["patient"]["count"] == len(record.split.val)   # the recorded side
    assert figures["slide"]["count"] == figures["count"] >= 2                                   # a sample per slide


def test_five_ranks_train_whole_slides_as_one_process_with_every_pool(shared_launch):
    shared_launch(JOB).require_clean(["canvases read by tile", *(case_name(case) for case in CASES),
                                      *(cli_case_name(case) for case in CASES if case.cli), VIT_INFER,
                                      "patients on one side", "canvases recorded"])


@pytest.mark.parametrize("pool", ["max", "attention", "tissue-mean"])
def test_every_slide_level_pool_trains_whole_slides_on_one_process(pool, cohort, tmp_path, capsys):
    """Issue 51: refused until then ("meant to be held in tiles"); the 5-rank launch checks it equals the tiles."""
    manifest, _ = cohort
    flags = ["--whole-slide", "--cohort", str(manifest), "--image-size", "64", "--mpp", "2", *SMALL, "--steps", "1",
             "--pool", pool, "--batch-size", "1", "--checkpoint-dir", str(tmp_path / "c")]
    assert cli.main(flags) == 0
    out = capsys.readouterr()
    assert ("note: --batch-size 1 with --pool" in out.err) == (pool != "max"), out.err   # averaging pools at batch 1
    summary = json.loads(out.out.strip().splitlines()[-1])
    assert summary["world_size"] == 1 and summary["steps_run"] == 1 and np.isfinite(summary["loss"])
    assert read_checkpoint(summary["checkpoint"]).record.model.pool.value == pool
