"""4 ranks per window (real mpiexec): exact against the whole-slide network in one process, square and vertical.

tests/mpi/infer_exact.py makes tests/infer/conftest.py's checkpoint and slide itself, so it runs in the shared
4-rank launches (tests/support/battery.py) of both planes rather than in two launches of its own."""

from __future__ import annotations

import pytest

from tests.mpi import infer_exact
from tests.support.battery import shared_job
from tests.support.planes import backend_flag

JOB = shared_job(4, "infer_exact", timeout=600)
TORCH_PLANE = shared_job(4, "infer_exact", backend_flag("gloo"), plane="gloo", timeout=600)


@pytest.mark.parametrize("name", [infer_exact.SQUARE, infer_exact.VERTICAL, infer_exact.SEGMENTATION,
                                  infer_exact.TILES])
def test_four_ranks_equal_one_process(shared_launch, name):
    shared_launch(JOB).require([name])


def test_four_ranks_on_the_torch_plane(shared_launch):
    """The same checks on gloo: the code path NCCL takes (one batch_isend_irecv group per exchange)."""
    shared_launch(TORCH_PLANE).require([infer_exact.SQUARE, infer_exact.VERTICAL, infer_exact.SEGMENTATION])
