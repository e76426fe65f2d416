"""InferJob (infer/job.py): the command line and ``dl.infer``'s keywords build the same job for every kind; the kind
the flags and the checkpoint decide; refusals before any work that were tracebacks (a whole-slide run's or a volume's
``--output`` in a place that cannot take it, a volume classifier given to ``infer --volume``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import mpi4dl_nb as dl
from mpi4dl_nb.checkpoint.files import CheckpointChoice, CheckpointSelect
from mpi4dl_nb.cli import infer_cmd
from mpi4dl_nb.comm.device import DeviceChoice
from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.data.resolution import ResolutionChoice
from mpi4dl_nb.data.task import Task
from mpi4dl_nb.infer.job import InferJob, InferKind
from mpi4dl_nb.infer.tile_map import MapMode
from tests.support.infer_data import bright_detector, tissue_image, write_slide

UNWRITABLE = Path("/proc")        # no process, root included, creates files here


def both(argv: list[str], keywords: dict[str, object]) -> InferJob:
    """The job of ``argv`` (the command's parser) after checking it equals the job of ``keywords``."""
    from_flags = infer_cmd.parse_job(argv)
    assert from_flags == InferJob.from_keywords(keywords)
    return from_flags


def test_a_slide_from_flags_equals_the_slide_from_keywords():
    job = both(
        ["--checkpoint", "ck", "--checkpoint-select", "best", "--slide", "s.svs", "--output", "a.tif:labels",
         "--output", "b.geojson", "--mpp", "0.5", "--source-mpp", "0.25", "--num-spatial-parts", "4",
         "--slice-method", "vertical", "--window", "256", "--memory-budget", "1000", "--batch-windows", "2",
         "--max-window-rows", "3", "--tissue-only", "--min-tissue", "0.1", "--output-stride", "8", "--heat-class",
         "1", "--threshold", "0.7", "--min-area", "10", "--exclude-class", "background", "--exclude-class", "2",
         "--overlay-side", "800", "--overwrite", "--dtype", "float64", "--task", "classification", "--model",
         "torchvision:resnet18", "--no-stain-normalize", "--backend", "gloo", "--device", "cpu", "--no-progress"],
        dict(checkpoint=Path("ck"), checkpoint_select="best", slide=Path("s.svs"), output=["a.tif:labels",
             Path("b.geojson")], mpp=0.5, source_mpp="0.25", num_spatial_parts=4, slice_method="vertical",
             window=256, memory_budget=1000, batch_windows="2", max_window_rows=3, tissue_only=True, min_tissue=0.1,
             output_stride=8, heat_class=1, threshold=0.7, min_area=10.0, exclude_class=("background", "2"),
             overlay_side=800, overwrite=True, dtype="float64", task=Task.CLASSIFICATION,
             model="torchvision:resnet18", stain_normalize=False, backend="gloo", device="cpu", progress=False))
    assert job.asked is InferKind.SLIDE and job.checkpoint == CheckpointChoice("ck", CheckpointSelect.BEST)
    assert job.outputs == ("a.tif:labels", "b.geojson") and job.exclude_classes == ("background", "2")
    assert job.resolution == ResolutionChoice(mpp=0.5, source_mpp=0.25) and job.device == DeviceChoice("gloo", "cpu")
    assert (job.window, job.task, job.min_area, job.progress, job.stain_normalize) == (
        256, Task.CLASSIFICATION, 10.0, False, False)


def test_a_cohort_from_flags_equals_the_cohort_from_keywords():
    job = both(["--checkpoint", "ck", "--cohort", "c.csv", "--output", "out/{slide}.npy", "--summary", "t.csv",
                "--slide-level", "1", "--map-mode", "tiles", "--magnification", "20", "--resume-outputs"],
               dict(checkpoint="ck", cohort="c.csv", output="out/{slide}.npy", summary="t.csv", slide_level=1,
                    map_mode=MapMode.TILES, magnification=20, resume_outputs=True))
    assert job.asked is InferKind.COHORT and job.map_mode is MapMode.TILES and job.slide_level == 1
    assert job.resolution.target == pytest.approx(0.5) and job.outputs == ("out/{slide}.npy",)
    listed = both(["--checkpoint", "ck", "--slides", "a.svs,b.svs", "--output", "o/{slide}.tif"],
                  dict(checkpoint="ck", slides="a.svs,b.svs", output=["o/{slide}.tif"]))
    assert listed.asked is InferKind.COHORT and listed.slide_source == "a.svs,b.svs"


def test_a_volume_from_flags_equals_the_volume_from_keywords():
    job = both(["--checkpoint", "ck", "--volume", "v.tif", "--output", "seg.nii.gz", "--window", "20,32,40",
                "--slice-method", "1X1x2", "--num-spatial-parts", "2", "--dtype", "float64"],
               dict(checkpoint="ck", volume="v.tif", output="seg.nii.gz", window=(20, 32, 40), slice_method="1x1x2",
                    num_spatial_parts="2", dtype="float64"))
    assert job.asked is InferKind.VOLUME and job.window == (20, 32, 40) and job.volume_slice_method() == "1x1x2"
    plain = both(["--checkpoint", "ck", "--volume", "v.tif", "--output", "seg.tif"],
                 dict(checkpoint="ck", volume="v.tif", output="seg.tif"))
    assert plain.volume_window() == 64 and plain.volume_slice_method() == "1x1x1"


def test_keywords_are_refused_naming_the_setting():
    with pytest.raises(ConfigError, match="windw: is not a setting of infer; did you mean window"):
        InferJob.from_keywords(dict(checkpoint="ck", slide="s", output="o.npy", windw=3))
    with pytest.raises(ConfigError, match="output: is required: give output=..."):
        InferJob.from_keywords(dict(checkpoint="ck", slide="s"))
    with pytest.raises(ConfigError, match="--map-mode: 'tile': choose one of auto, dense, tiles"):
        InferJob.from_keywords(dict(checkpoint="ck", slide="s", output="o.npy", map_mode="tile"))
    with pytest.raises(ConfigError, match="--slides: --slide and --slides both given"):
        InferJob.from_keywords(dict(checkpoint="ck", slide="s", slides="d", output="o.npy")).check()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tile classifier, a whole-slide model and two small slides with a manifest."""
    from tests.support.whole_slide_model import structure_detector

    root = tmp_path_factory.mktemp("job")
    (root / "slides").mkdir()
    for name in ("s1", "s2"):
        write_slide(root / "slides" / f"{name}.tif", tissue_image(64, 64), mpp=0.5)
    (root / "cohort.csv").write_text("slide,label,patient\nslides/s1.tif,negative,P1\nslides/s2.tif,positive,P2\n")
    return root, bright_detector(root / "tiles"), structure_detector(root / "whole", "attention", 64, 0.5)


def test_check_decides_the_kind_from_the_flags_and_the_checkpoint(checkpoints, tmp_path):
    root, tiles, whole = checkpoints
    slide = str(root / "slides" / "s1.tif")
    checked = InferJob.from_keywords(dict(checkpoint=tiles, slide=slide, output=tmp_path / "m.npy")).check()
    assert checked.kind is InferKind.SLIDE and checked.checkpoint.parent == tiles and not checked.slides
    (tmp_path / "out").mkdir()
    checked = InferJob.from_keywords(dict(checkpoint=tiles, slides=root / "slides",
                                          output=tmp_path / "out" / "{slide}.npy")).check()
    assert checked.kind is InferKind.COHORT and [s.path.name for s in checked.slides] == ["s1.tif", "s2.tif"]
    for source in (dict(slide=slide), dict(cohort=root / "cohort.csv")):
        checked = InferJob.from_keywords(dict(checkpoint=whole, output=tmp_path / "dir", **source)).check()
        assert checked.kind is InferKind.SLIDE_LEVEL and checked.record is not None
    assert [(s.label, s.patient) for s in checked.slides] == [("negative", "P1"), ("positive", "P2")]


def test_slide_level_from_flags_equals_slide_level_from_keywords(checkpoints, tmp_path):
    root, _, whole = checkpoints
    slides = f"{root / 'slides' / 's1.tif'},{root / 'slides' / 's2.tif'}"
    job = both(["--checkpoint", str(whole), "--slides", slides, "--output", str(tmp_path / "dir"), "--magnification",
                "20", "--slice-method", "vertical", "--num-spatial-parts", "2", "--no-stain-normalize", "--overwrite",
                "--dtype", "float64"],
               dict(checkpoint=whole, slides=slides, output=tmp_path / "dir", magnification=20.0,
                    slice_method="vertical", num_spatial_parts=2, stain_normalize=False, overwrite=True,
                    dtype="float64"))
    checked = job.check()
    assert checked == InferJob.from_keywords(dict(checkpoint=whole, slides=slides, output=tmp_path / "dir",
                                                  magnification=20, slice_method="vertical", num_spatial_parts=2,
                                                  stain_normalize=False, overwrite=True, dtype="float64")).check()
    assert checked.kind is InferKind.SLIDE_LEVEL and len(checked.slides) == 2 and not (tmp_path / "dir").exists()
    with pytest.raises(ConfigError, match="--window: not for a whole-slide model .*; drop --window, --tissue-only"):
        replace(job, window=64, tissue_only=True).check()


def test_dl_infer_runs_the_commands_job(checkpoints, tmp_path):
    root, tiles, _ = checkpoints
    summary = dl.infer(checkpoint=tiles, slide=root / "slides" / "s1.tif", output=[tmp_path / "m.npy"],
                       dtype="float64", progress=False)
    assert summary is not None and summary["complete"] and (tmp_path / "m.npy").is_file()


def run(capsys, *argv: object) -> tuple[int, str]:
    code = infer_cmd.main([str(a) for a in argv] + ["--no-progress"])
    return code, capsys.readouterr().err


def test_a_whole_slide_runs_output_that_cannot_be_written_is_refused_before_work(checkpoints, tmp_path, capsys):
    root, _, whole = checkpoints
    code, err = run(capsys, "--checkpoint", whole, "--cohort", root / "cohort.csv", "--output", UNWRITABLE / "out")
    assert code == 2 and "Traceback" not in err and "started" not in err
    assert f"--output: {UNWRITABLE / 'out'}: cannot write in {UNWRITABLE}" in err


def resnet3d_checkpoint(directory: Path) -> Path:
    """A 3-D ResNet classifier's checkpoint as ``train --task classification --model resnet3d`` records it."""
    from mpi4dl_nb.checkpoint.record import DataRecord, RunRecord, write_checkpoint
    from mpi4dl_nb.data.apps import AppKind
    from mpi4dl_nb.models.spec import ModelSpec

    spec = ModelSpec.of("resnet3d", num_layers=10, num_filters=2, num_classes=2, in_channels=1)
    torch.manual_seed(0)
    layers = spec.build((16, 16, 16))
    record = RunRecord(spec, DataRecord(AppKind.MEDICAL, 16, 2, "float32", classes=("benign", "tumour")),
                       task=Task.CLASSIFICATION)
    write_checkpoint(directory, record.at(1, "a0b1c2d3e4f5"), torch.nn.Sequential(*layers).state_dict(), None)
    return directory


def test_a_volume_classifier_or_an_unwritable_volume_output_is_refused_before_work(tmp_path, capsys):
    import tifffile

    from mpi4dl_nb.models.spec import ModelSpec
    from tests.mpi import volume_infer
    from tests.support.infer_data import write_network

    tifffile.imwrite(tmp_path / "vol.tif", np.zeros((16, 16, 16), np.uint8))
    classifier = resnet3d_checkpoint(tmp_path / "r3")
    code, err = run(capsys, "--checkpoint", classifier, "--volume", tmp_path / "vol.tif", "--output",
                    tmp_path / "seg.tif")
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "--checkpoint: " in err and "resnet3d 10 layers" in err and "a classifier" in err
    assert "dense segmentation network (e.g. train --task segmentation --model unet3d)" in err
    assert "train --val-fraction or --folds" in err and not (tmp_path / "seg.tif").exists()
    with pytest.raises(ConfigError, match="resnet3d 10 layers .* a classifier"):
        dl.infer_volume(classifier, np.zeros((1, 16, 16, 16)), None)
    spec = ModelSpec.of("unet3d", num_layers=1, num_filters=2, num_classes=volume_infer.CLASSES, in_channels=1,
                        upsampling="transposed")
    unet = write_network(tmp_path / "u3", volume_infer.network(), spec, 16, ("background", "cell", "nucleus"))
    code, err = run(capsys, "--checkpoint", unet, "--volume", tmp_path / "vol.tif", "--output",
                    UNWRITABLE / "seg.tif")
    assert code == 2 and "Traceback" not in err
    assert f"--output: {UNWRITABLE / 'seg.tif'}: cannot write in {UNWRITABLE}" in err
    with pytest.raises(ValueError, match=f"cannot write in {UNWRITABLE}"):       # ConfigError, agreed: SetupFailed
        dl.infer_volume(unet, np.zeros((1, 16, 16, 16)), UNWRITABLE / "seg.tif")
