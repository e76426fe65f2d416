"""The op families of torchvision and timm CNNs on tiles (issue 34): channel LayerNorm in both spellings,
BatchNormAct2d, reductions over the image in every spelling, channel shuffles, dropout, resampling to
another tile's size, each float64-exact against one process on 2x2, 1x4 and 3x1 grids, what stays
refused named with its module and op (tests/mpi/spatial_families.py); and the feature trunks of nine
torchvision/timm CNNs plus a torchvision DeepLabV3 exact on 2x2 tiles (tests/mpi/trunks_exact.py); a stage
of those families trains through HybridEngine (SP+LP) like one process (tests/mpi/families_engine.py).

Each program runs in the shared launch of its world size (tests/support/battery.py).
"""

from __future__ import annotations

import pytest

from tests.mpi.families_engine import CHECKS as ENGINE_CHECKS
from tests.mpi.spatial_families import check_names as family_checks
from tests.mpi.trunks_exact import check_names as trunk_checks
from tests.support.battery import shared_job
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

GRIDS = [(2, 2), (1, 4), (3, 1)]
FAMILY_JOBS = {(rows, cols): shared_job(rows * cols, "spatial_families", rows, cols, timeout=300)
               for rows, cols in GRIDS}
ENGINE_JOB = shared_job(5, "families_engine", timeout=180)
MISSING = missing_modules("torchvision", "timm")
TRUNK_JOB = None if MISSING else shared_job(4, "trunks_exact", timeout=900)


@pytest.mark.parametrize("rows,cols", GRIDS, ids=[f"{r}x{c}" for r, c in GRIDS])
def test_op_families_exact_or_refused(shared_launch, rows, cols):
    shared_launch(FAMILY_JOBS[(rows, cols)]).require(family_checks())


def test_op_families_train_through_the_engine_like_one_process(shared_launch):
    shared_launch(ENGINE_JOB).require(ENGINE_CHECKS)


def test_torchvision_and_timm_trunks_equal_one_process(shared_launch):
    require_or_skip(MISSING, "the torchvision/timm trunks", MODELS_EXTRA)
    assert TRUNK_JOB is not None
    shared_launch(TRUNK_JOB).require(trunk_checks())
