"""Evaluation on 5 ranks (SP+LP, GEMS, 5 data-parallel replicas) equals one process and changes no state."""
from __future__ import annotations

import pytest

from tests.mpi.evaluation_exact import CONFIGS


@pytest.mark.parametrize("name", list(CONFIGS))
def test_evaluation_equals_serial_and_touches_no_state(mpi_checks, name):
    mpi_checks(5, "evaluation_exact", timeout=600).require([f"{name} equals serial", f"{name} touches no state"])


def test_evaluation_on_the_torch_plane(mpi_checks):
    """The forward-only round on gloo (one-way channels, messages matched in posting order)."""
    mpi_checks(5, "evaluation_exact", "--backend=gloo", "sp+lp", timeout=600).require(
        ["sp+lp equals serial", "sp+lp touches no state"])
