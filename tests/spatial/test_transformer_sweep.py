"""Every other timm transformer on tiles is exact or refused naming its layer (issue 52): one model per timm module,
under mpiexec on a 1x2 grid (tests/mpi/transformer_sweep.py, in the shared 2-rank launch)."""

from __future__ import annotations

from tests.support.battery import shared_job
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

MISSING = missing_modules("timm")
JOB = None if MISSING else shared_job(2, "transformer_sweep", timeout=400)


def test_every_other_timm_transformer_is_exact_or_refused_naming_its_layer(shared_launch):
    from tests.mpi.transformer_sweep import check_names

    require_or_skip(MISSING, "timm's transformers", MODELS_EXTRA)
    assert JOB is not None
    shared_launch(JOB).require(check_names())
