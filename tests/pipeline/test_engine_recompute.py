"""HybridEngine with activation recomputation and bf16 on 5 ranks (SP 2x2 + LP), one job per plane.

See tests/mpi/engine_recompute.py for what each named check compares.
"""

from __future__ import annotations

import pytest

from tests.mpi.engine_recompute import CASES
from tests.support.battery import shared_job

JOB = shared_job(5, "engine_recompute", timeout=400)
TORCH_PLANE = shared_job(5, "engine_recompute", "--backend=gloo", "sp_se_pp 2", "bf16", plane="gloo", timeout=400)


@pytest.mark.parametrize("case", list(CASES))
def test_recomputation_is_exact(shared_launch, case):
    """Bit-identical losses and the same state with and without recomputation, both == serial."""
    shared_launch(JOB).require([f"recompute {case}"])


def test_recomputation_cuts_spatial_activation_peak(shared_launch):
    """Counted activation peak of the spatial ranks at most 0.7x with checkpoint_activations='every'."""
    shared_launch(JOB).require(["recompute memory"])


def test_bf16_trains_like_fp32_and_like_serial_bf16(shared_launch):
    shared_launch(JOB).require(["bf16 vs fp32", "bf16 vs serial"])


def test_fp16_refused_on_cpu(shared_launch):
    shared_launch(JOB).require(["fp16 refused"])


def test_recomputation_and_bf16_on_the_torch_plane(shared_launch):
    """The same code path on gloo (NCCL's call pattern): spatial recomputation with SE gates, bf16 halos."""
    shared_launch(TORCH_PLANE).require(["recompute sp_se_pp 2", "bf16 vs fp32", "bf16 vs serial"])
