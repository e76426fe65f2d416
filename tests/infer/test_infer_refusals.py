"""Issue 42's silent, traceback and misleading cases of ``infer`` (and of annotations), each one line naming the fix;
the default class of the ``.png``, printed."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mpi4dl_nb.cli import train_cmd
from mpi4dl_nb.cli.infer_cmd import main as infer_main
from mpi4dl_nb.infer.outputs.heat import default_heat_class
from tests.support.infer_data import bright_detector, square_slide, tissue_image, write_slide
from tests.support.pyramid import write_pyramid


@pytest.fixture(scope="module")
def bright(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    return root, bright_detector(root / "ck", mpp=1.0), square_slide(root / "s.tif", 160, 160, (48, 96, 48, 96),
                                                                     mpp=0.5)


def run(capsys, *argv: object) -> tuple[int, str]:
    code = infer_main([str(a) for a in argv] + ["--no-progress"])
    return code, capsys.readouterr().err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_an_output_that_cannot_be_written_is_named_in_one_line(bright, tmp_path, capsys):
    _, checkpoint, slide = bright
    code, err = run(capsys, "--checkpoint", checkpoint, "--slide", slide, "--output", "/proc/m.tif")
    assert code == 2 and "/proc/m.tif: cannot write in /proc" in one_line(err)
    if os.geteuid() != 0:                                 # root writes into read-only folders anyway
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        code, err = run(capsys, "--checkpoint", checkpoint, "--slide", slide, "--output", locked / "m.tif")
        assert code == 2 and f"cannot write in {locked}" in one_line(err)


def test_an_output_folder_that_is_a_file_says_so(bright, tmp_path, capsys):
    _, checkpoint, slide = bright
    (tmp_path / "notadir").write_text("")
    code, err = run(capsys, "--checkpoint", checkpoint, "--slide", slide, "--output", tmp_path / "notadir" / "m.tif")
    assert code == 2 and f"{tmp_path / 'notadir'} is a file, not a folder" in one_line(err)


def test_a_missing_slide_folder_of_a_cohort_is_an_output_problem(bright, tmp_path, capsys):
    _, checkpoint, slide = bright
    (tmp_path / "slides").mkdir()
    write_slide(tmp_path / "slides" / "a.tif", tissue_image(96, 96), mpp=0.5)
    code, err = run(capsys, "--checkpoint", checkpoint, "--slides", tmp_path / "slides", "--output",
                    tmp_path / "out" / "{slide}" / "m.npy")
    line = one_line(err)
    assert code == 2 and "--output" in line and "--summary" not in line
    assert f"folder {tmp_path / 'out' / 'a'} does not exist; create it first" in line


def test_a_slide_too_small_names_the_size_read_and_the_level(bright, tmp_path, capsys):
    _, checkpoint, _ = bright
    small = write_slide(tmp_path / "small.tif", tissue_image(40, 48), levels=1, mpp=0.5)   # 20 x 24 px at 1 µm/px
    code, err = run(capsys, "--checkpoint", checkpoint, "--slide", small, "--output", tmp_path / "m.npy")
    line = one_line(err)
    assert code == 2 and "is 24x20 px as read (level 0, 48x40 px, shrunk by 2, 1 µm/px)" in line


def test_a_broken_slide_of_a_cohort_leaves_no_partial_output(bright, tmp_path, capsys):
    _, checkpoint, _ = bright
    folder = tmp_path / "slides"
    folder.mkdir()
    good = write_slide(folder / "good.tif", tissue_image(96, 96), mpp=0.5)
    data = bytearray(good.read_bytes())
    broken = folder / "broken.tif"
    broken.write_bytes(bytes(data[:len(data) // 2]) + bytes(len(data) - len(data) // 2))   # tiles zeroed: unreadable
    (tmp_path / "out").mkdir()
    code, err = run(capsys, "--checkpoint", checkpoint, "--slides", folder, "--output", tmp_path / "out" /
                    "{slide}.npy")
    assert code == 3 and "broken.tif" in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["good.npy", "summary.csv"]


def test_the_png_draws_a_positive_class_by_default_and_says_which(bright, capsys, tmp_path):
    assert default_heat_class(["DAB", "no DAB"]) == 0
    assert default_heat_class(["background", "tumor", "stroma"]) == 1
    assert default_heat_class(["non-tumour", "tumour"]) == 1 and default_heat_class(["dark", "bright"]) == 1
    assert default_heat_class(["normal", "benign"]) == 1
    _, checkpoint, slide = bright
    code, err = run(capsys, "--checkpoint", checkpoint, "--slide", slide, "--output", tmp_path / "m.png")
    assert code == 0 and "the .png/.tif:preview draw P(bright) (class 1); --heat-class N draws another" in err


def test_annotations_without_areas_are_refused_naming_the_file(tmp_path, capsys):
    folder = tmp_path / "slides"
    folder.mkdir()
    write_pyramid(folder / "s1.tif", np.random.default_rng(0).integers(60, 200, (128, 128, 3), dtype=np.uint8),
                  levels=2, tile=64)
    point = {"type": "Feature", "geometry": {"type": "Point", "coordinates": [10, 10]},
             "properties": {"classification": {"name": "tumor"}}}
    line = {"type": "Feature", "geometry": {"type": "LineString", "coordinates": [[0, 0], [9, 9]]},
            "properties": {"classification": {"name": "tumor"}}}
    (folder / "s1.geojson").write_text(json.dumps({"type": "FeatureCollection", "features": [point, line]}))
    with pytest.raises(SystemExit) as stop:
        train_cmd.main(["--task", "segmentation", "--model", "unet", "--num-layers", "2", "--num-filters", "4",
                        "--datapath", str(folder), "--classes", "background,tumor", "--image-size", "32",
                        "--batch-size", "2", "--steps", "1", "--min-tissue", "0", "--no-progress",
                        "--split-size", "1", "--spatial-size", "0"])
    code = stop.value.code
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert f"{folder / 's1.geojson'}: no areas to draw a mask from (1 Point, 1 LineString)" in captured.err


def test_a_cohort_manifest_drives_inference_and_its_table_lines_up_with_evaluate(bright, tmp_path, capsys):
    import csv

    from mpi4dl_nb.data.cohort_slides import CohortSlides
    from mpi4dl_nb.data.groups import groups_of
    from mpi4dl_nb.data.manifest import read_cohort

    _, checkpoint, _ = bright
    (tmp_path / "scans").mkdir()
    for name, side in (("s1", 96), ("s2", 128)):
        write_slide(tmp_path / "scans" / f"{name}.tif", tissue_image(side, side), mpp=0.5)
    manifest = tmp_path / "cohort.csv"
    manifest.write_text("slide,label,patient,site\nscans/s1.tif,bright,P1,lab A\nscans/s2.tif,dark,P2,lab B\n")
    (tmp_path / "out").mkdir()
    code, err = run(capsys, "--checkpoint", checkpoint, "--cohort", manifest, "--output",
                    tmp_path / "out" / "{slide}.npy")
    assert code == 0, err
    with open(tmp_path / "out" / "summary.csv") as handle:
        rows = {r["slide"]: r for r in csv.DictReader(handle)}
    assert {k: (r["label"], r["patient"], r["status"]) for k, r in rows.items()} == {
        "s1": ("bright", "P1", "done"), "s2": ("dark", "P2", "done")}
    evaluated = groups_of(CohortSlides(read_cohort(manifest), 32, min_tissue=0.0))   # as evaluate --cohort names them
    assert set(evaluated.slides) == set(rows)
    manifest.write_text("slide,label\nscans/s1.tif,tumour\n")
    code, err = run(capsys, "--checkpoint", checkpoint, "--slides", manifest, "--output",
                    tmp_path / "out" / "{slide}.npy", "--overwrite")
    assert code == 2 and "line 2" in err and "tumour" in err and "Traceback" not in err


@pytest.mark.parametrize("extra, fragment", [
    (["--map-mode", "tiles", "--resume-outputs"], "--map-mode: tiles runs the whole slide in one go; drop "
                                                  "--resume-outputs"),
    (["--map-mode", "tiles", "--tissue-only"], "drop --tissue-only, or use --map-mode dense"),
])
def test_tile_mode_refuses_what_it_cannot_do(bright, tmp_path, capsys, extra, fragment):
    _, checkpoint, slide = bright
    code, err = run(capsys, "--checkpoint", checkpoint, "--slide", slide, "--output", tmp_path / "m.npy", *extra)
    assert code == 2 and fragment in one_line(err)


def test_tile_mode_refuses_a_segmentation_network(tmp_path, capsys):
    from tests.support.infer_data import unet_checkpoint

    checkpoint = unet_checkpoint(tmp_path / "ck", mpp=0.5)
    slide = write_slide(tmp_path / "s.tif", tissue_image(64, 64), mpp=0.5)
    code, err = run(capsys, "--checkpoint", checkpoint, "--slide", slide, "--output", tmp_path / "m.npy",
                    "--map-mode", "tiles")
    assert code == 2 and "use --map-mode dense or auto (the default) for a segmentation network" in one_line(err)
