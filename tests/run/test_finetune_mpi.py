"""train's fine-tuning flags on 5 ranks (SP+LP, GEMS) equal one process in float64 (tests/mpi/finetune_exact.py):
AdamW, cosine schedule with warm-up, class weights, flip/rot90/color/hed augmentation; resume continues exactly."""
from __future__ import annotations

import pytest

from tests.mpi.finetune_exact import LAYOUTS
from tests.support.battery import shared_job

JOB = shared_job(5, "finetune_exact", timeout=400)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_adamw_cosine_warmup_augment_equal_one_process(shared_launch, layout):
    """Acceptance: 5 ranks give the losses (and weights) of one process within 1e-9; AdamW's state is the same on
    every holder of a stage."""
    shared_launch(JOB).require([f"{layout} losses equal one process", f"{layout} adamw state equal on every holder"])


def test_a_resumed_run_continues_with_the_same_losses(shared_launch):
    shared_launch(JOB).require(["sp+lp resumed run continues exactly"])
