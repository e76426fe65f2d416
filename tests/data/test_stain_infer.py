"""Stain normalisation end to end in one process: ``train --stain-normalize`` records the normaliser in its checkpoint,
``evaluate`` reads through it, and ``infer`` applies it without flags (window by window equal to the network on the
whole normalised slide), or not with ``--no-stain-normalize``."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from mpi4dl_nb.checkpoint.record import read_checkpoint
from mpi4dl_nb.data import ihc_image
from mpi4dl_nb.data.stain import StainMethod
from mpi4dl_nb.infer.api import infer_slide
from mpi4dl_nb.infer.model import find_checkpoint
from tests.support.infer_data import make_checkpoint, make_slide, relative_difference, whole_slide_reference


@pytest.fixture(scope="module")
def stained_run(tmp_path_factory):
    """(folder, checkpoint trained with Macenko normalisation to a reference tile, a slide)."""
    root = tmp_path_factory.mktemp("stain_infer")
    reference = root / "reference.png"
    Image.fromarray((ihc_image()[256:, 256:] * np.array([0.9, 0.8, 1.0])).astype(np.uint8)).save(reference)
    checkpoint = make_checkpoint(root / "ck", "--stain-normalize", "macenko", "--stain-reference", str(reference))
    return root, checkpoint, make_slide(root / "slide.tif", 150, 330)


def test_train_records_the_normaliser(stained_run):
    _, checkpoint, _ = stained_run
    record = read_checkpoint(find_checkpoint(checkpoint)).record
    assert record.stain is not None and record.stain.method is StainMethod.MACENKO
    assert record.stain.reference == "reference.png" and len(record.stain.fingerprint) == 16
    assert record.identity["stain"] == record.stain.describe()


def test_infer_applies_the_checkpoints_normaliser_without_flags(stained_run):
    root, checkpoint, slide = stained_run
    infer_slide(checkpoint, slide, [str(root / "a.npy")], window=128, dtype="float64")
    normalised = whole_slide_reference(checkpoint, slide, stain=True)
    assert relative_difference(np.load(root / "a.npy"), normalised) <= 1e-12
    infer_slide(checkpoint, slide, [str(root / "b.npy")], window=128, dtype="float64", stain_normalize=False)
    stored = whole_slide_reference(checkpoint, slide)
    assert relative_difference(np.load(root / "b.npy"), stored) <= 1e-12
    assert relative_difference(normalised, stored) > 1e-6, "the normaliser changed nothing"


def test_infer_command_flag_turns_it_off(stained_run, capsys):
    from mpi4dl_nb.cli.infer_cmd import main

    root, checkpoint, slide = stained_run
    assert main(["--checkpoint", str(checkpoint), "--slide", str(slide), "--output", str(root / "c.npy"),
                 "--window", "128", "--dtype", "float64", "--no-stain-normalize", "--no-progress"]) == 0
    assert relative_difference(np.load(root / "c.npy"), whole_slide_reference(checkpoint, slide)) <= 1e-12


def test_evaluate_reads_through_the_checkpoints_normaliser(stained_run):
    from mpi4dl_nb.run.evaluate_job import EvaluateJob, EvaluatePlan
    from mpi4dl_nb.run.evaluate_run import resolved_data
    from mpi4dl_nb.run.job_data import dataset_from

    _, checkpoint, _ = stained_run
    record = read_checkpoint(find_checkpoint(checkpoint)).record
    job = EvaluateJob.of(checkpoint=str(checkpoint), split_size=1, spatial_size=0)
    data = resolved_data(EvaluatePlan(job, str(checkpoint)), record)
    assert data.stain == record.stain
    dataset = dataset_from(data, 0, data.datapath)
    assert not np.allclose(dataset.read(0).numpy(), dataset.read_pixels(0).numpy(), atol=1e-3)
