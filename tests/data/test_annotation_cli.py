"""``train`` on an annotated slide whose polygon has a hole crossing its outer ring: refused before the first step
naming the file, the feature and why; with ``--repair-annotations`` it trains and says what it changed. ``--tissue``
and ``--repair-annotations`` taken by train, evaluate and infer alike (refused where they cannot apply)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from mpi4dl_nb.cli import evaluate_cmd, infer_cmd
from mpi4dl_nb.cli import train_cmd as cli
from mpi4dl_nb.cli.job_flags import parsed_job
from mpi4dl_nb.data.tissue_mask import TissueMethod
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.run.evaluate_job import EvaluateJob
from mpi4dl_nb.run.job import TrainJob
from tests.support.pyramid import write_pyramid
from tests.support.segmentation_data import write_pairs
from tests.support.train_in_process import run_train

UNET = ["--task", "segmentation", "--model", "unet", "--num-layers", "2", "--num-filters", "4"]
RUN = ["--classes", "background,tumor", "--image-size", "32", "--batch-size", "2", "--steps", "1", "--min-tissue",
       "0", "--no-progress", "--split-size", "1", "--spatial-size", "0"]
CROSSING = [[[10, 10], [60, 10], [60, 60], [10, 60], [10, 10]], [[40, 20], [90, 20], [90, 50], [40, 50], [40, 20]]]


def annotated_slide(folder):
    folder.mkdir()
    write_pyramid(folder / "s1.tif", np.random.default_rng(0).integers(60, 200, (64, 128, 3), dtype=np.uint8),
                  levels=2, tile=32)
    feature = {"type": "Feature", "id": "t7", "geometry": {"type": "Polygon", "coordinates": CROSSING},
               "properties": {"name": "Tumour A", "classification": {"name": "tumor"}}}
    (folder / "s1.geojson").write_text(json.dumps({"type": "FeatureCollection", "features": [feature]}))
    return folder


def test_a_hole_crossing_its_outer_ring_is_refused_then_repaired_on_request(tmp_path, capsys):
    folder = annotated_slide(tmp_path / "slides")
    code, out, err = run_train([*UNET, "--datapath", str(folder), *RUN], capsys)
    assert code == 2 and out == ""
    assert ("s1.geojson: feature 0 ('t7', 'Tumour A'): hole 1 crosses the outer ring near (60.0, 20.0); this tumor "
            "polygon is invalid: fix it in QuPath, or pass --repair-annotations") in err
    code, out, err = run_train([*UNET, "--datapath", str(folder), *RUN, "--repair-annotations"], capsys)
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["steps"] == 1
    assert err.count("--repair-annotations: ") == 1
    assert ("s1.geojson: feature 0 ('t7', 'Tumour A'), class 'tumor', repaired (hole 1 crosses the outer ring near "
            "(60.0, 20.0)): area 2,800 -> 1,900 square pixels at level 0") in err


def test_repair_is_refused_for_images_with_masks_which_have_no_polygons(tmp_path, capsys):
    folder = write_pairs(tmp_path / "pairs", count=4, size=32)
    three = [word.replace("background,tumor", "background,disc,corner") for word in RUN]   # write_pairs' classes
    code, out, err = run_train([*UNET, "--datapath", str(folder), *three, "--repair-annotations"], capsys)
    assert code == 2 and out == ""
    assert "--repair-annotations: repairs the QuPath polygons of annotated slides" in err
    assert "(images/ with masks/: pixels, no polygons) are read as they are: drop it" in err
    assert "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, flag, fragment", [
    (["--repair-annotations"], "--repair-annotations", "only --task segmentation reads"),
    (["--whole-slide", "--datapath", "x", "--tissue", "otsu"], "--tissue", "--whole-slide places each slide"),
])
def test_train_refuses_them_where_they_cannot_apply(argv, flag, fragment):
    with pytest.raises(ConfigError) as err:
        parsed_job(cli.train_parser().parse_args(argv), TrainJob, "train")
    assert err.value.knob == flag and fragment in str(err.value)


def test_every_command_that_cuts_slides_takes_tissue():
    train = parsed_job(cli.train_parser().parse_args(["--tissue", "otsu"]), TrainJob, "train")
    assert train.data.tissue is TissueMethod.OTSU
    args = evaluate_cmd.evaluate_parser().parse_args(["--checkpoint", "ck.pt", "--tissue", "otsu",
                                                      "--repair-annotations"])
    evaluate = parsed_job(args, EvaluateJob, "evaluate")
    assert evaluate.tissue is TissueMethod.OTSU and evaluate.repair_annotations
    infer = infer_cmd.parse_job(["--checkpoint", "ck", "--slide", "s.svs", "--output", "m.npy", "--tissue-only",
                                 "--tissue", "otsu"])
    assert infer.tissue is TissueMethod.OTSU
    with pytest.raises(SystemExit):
        cli.train_parser().parse_args(["--tissue", "median"])
