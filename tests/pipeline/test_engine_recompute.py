"""HybridEngine with activation recomputation and bf16 on 5 ranks (SP 2x2 + LP), one mpiexec launch.

See tests/mpi/engine_recompute.py for what each named check compares.
"""

from __future__ import annotations

import pytest

from tests.mpi.engine_recompute import CASES


def launch(mpi_checks):
    return mpi_checks(5, "engine_recompute", timeout=400)


@pytest.mark.parametrize("case", list(CASES))
def test_recomputation_is_exact(mpi_checks, case):
    """Bit-identical losses and the same state with and without recomputation, both == serial."""
    launch(mpi_checks).require([f"recompute {case}"])


def test_recomputation_cuts_spatial_activation_peak(mpi_checks):
    """Counted activation peak of the spatial ranks at most 0.7x with checkpoint_activations='every'."""
    launch(mpi_checks).require(["recompute memory"])


def test_bf16_trains_like_fp32_and_like_serial_bf16(mpi_checks):
    launch(mpi_checks).require(["bf16 vs fp32", "bf16 vs serial"])


def test_fp16_refused_on_cpu(mpi_checks):
    launch(mpi_checks).require(["fp16 refused"])


def test_recomputation_and_bf16_on_the_torch_plane(mpi_checks):
    """The same code path on gloo (NCCL's call pattern): spatial recomputation with SE gates, bf16 halos."""
    report = mpi_checks(5, "engine_recompute", "--backend=gloo", "sp_se_pp 2", "bf16", timeout=400)
    report.require(["recompute sp_se_pp 2", "bf16 vs fp32", "bf16 vs serial"])
