"""Your own model through the command line on 5 ranks (tests/mpi/byom_exact.py): a torchvision ResNet-18 from a
1000-class weights file trains SP+LP exactly like one process (float64, 1e-9); its checkpoint gives the model's
own state dict (strict load into torchvision) and runs through evaluate and infer without model flags."""
from __future__ import annotations

import pytest

from tests.mpi.byom_exact import CHECKS
from tests.support.battery import shared_job
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

MISSING = missing_modules("torchvision", "timm")
JOB = None if MISSING else shared_job(5, "byom_exact", timeout=600)


@pytest.mark.parametrize("name", CHECKS)
def test_your_own_model_on_5_ranks(shared_launch, name):
    require_or_skip(MISSING, "models from torchvision", MODELS_EXTRA)
    assert JOB is not None
    shared_launch(JOB).require([name])
