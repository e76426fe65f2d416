"""Evaluation on 5 ranks (SP+LP, GEMS, 5 data-parallel replicas) equals one process and changes no state."""
from __future__ import annotations

import pytest

from tests.mpi.evaluation_exact import CONFIGS, REFUSED
from tests.support.battery import shared_job

JOB = shared_job(5, "evaluation_exact", timeout=600)
TORCH_PLANE = shared_job(5, "evaluation_exact", "--backend=gloo", "sp+lp", plane="gloo", timeout=600)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_evaluation_equals_serial_and_touches_no_state(shared_launch, name):
    shared_launch(JOB).require([f"{name} equals serial", f"{name} touches no state"])


def test_training_with_dropout_on_replicas_is_refused_on_every_rank(shared_launch):
    shared_launch(JOB).require(list(REFUSED))


def test_evaluation_on_the_torch_plane(shared_launch):
    """The forward-only round on gloo (one-way channels, messages matched in posting order)."""
    shared_launch(TORCH_PLANE).require(
        ["sp+lp equals serial", "sp+lp touches no state"])
