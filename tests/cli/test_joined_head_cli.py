"""A classifier on P tiles from the command line needs P ranks, not P+1 (issue 80, item 3): ``train`` with every
stage spatial takes its loss on the joined logits every tile holds, equal to one process in float64 (ResNet with
BatchNorm and a small Swin on 2 and 4 tiles, ResNet on two spatial stages), ``evaluate`` takes the checkpoints on the
tiles and in one process to the same loss, and from Python every gradient equals one process's
(tests/mpi/joined_head_cli.py, a job of the shared 4-rank launch)."""
from __future__ import annotations

import pytest

from tests.mpi import joined_head_cli
from tests.support.battery import shared_job
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

MISSING = missing_modules("timm")
JOB = None if MISSING else shared_job(4, "joined_head_cli", timeout=400)


@pytest.fixture(autouse=True)
def _libraries() -> None:
    require_or_skip(MISSING, "timm's Swin", MODELS_EXTRA)


def test_a_classifier_trains_on_its_tiles_alone_as_one_process_and_evaluates_alike(shared_launch):
    assert JOB is not None
    shared_launch(JOB).require_clean(joined_head_cli.check_names())
