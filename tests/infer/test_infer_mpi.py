"""4 ranks per window (real mpiexec): exact against the whole-slide network in one process, square and vertical."""

from __future__ import annotations

import pytest

from tests.mpi import infer_exact
from tests.support.planes import backend_flag


@pytest.fixture(scope="module")
def report(infer_data, mpi_checks, tmp_path_factory):
    root, checkpoint, slide, _ = infer_data
    out = tmp_path_factory.mktemp("infer_mpi")
    return mpi_checks(4, "infer_exact", checkpoint, slide, out, timeout=600)


@pytest.mark.parametrize("name", [infer_exact.SQUARE, infer_exact.VERTICAL, infer_exact.SEGMENTATION,
                                  infer_exact.TILES])
def test_four_ranks_equal_one_process(report, name):
    report.require([name])


def test_four_ranks_on_the_torch_plane(infer_data, mpi_checks, tmp_path):
    """The same checks on gloo: the code path NCCL takes (one batch_isend_irecv group per exchange)."""
    _, checkpoint, slide, _ = infer_data
    mpi_checks(4, "infer_exact", checkpoint, slide, tmp_path, backend_flag("gloo"), timeout=600).require(
        [infer_exact.SQUARE, infer_exact.VERTICAL, infer_exact.SEGMENTATION])
