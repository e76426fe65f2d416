"""Subnormal floats flushed on a CPU rank (``comm/cpu_floats.py``, set by ``dl.init``): they compute as zeros in
float32, float64 keeps its range, and ``MPI4DL_KEEP_SUBNORMALS=1`` leaves the CPU's own handling."""

from __future__ import annotations

import pytest
import torch

from mpi4dl_nb.comm.cpu_floats import KEEP_ENV, flush_subnormals
from tests.support.requirements import require_or_skip

TINY = 1e-39     # below float32's smallest normal number (1.18e-38), a normal float64


def float32_product() -> float:
    return float((torch.tensor([TINY], dtype=torch.float32) * 3.0).item())


def test_flushed_subnormals_compute_as_zeros_in_float32_only(monkeypatch):
    supported = torch.set_flush_denormal(False)
    require_or_skip([] if supported else ["an x86 CPU"], "flushing subnormals (FTZ/DAZ)",
                    "run on x86, where torch.set_flush_denormal can set it")
    try:
        assert float32_product() == pytest.approx(3 * TINY, rel=1e-6)       # subnormals computed as numbers
        monkeypatch.setenv(KEEP_ENV, "1")
        assert not flush_subnormals() and float32_product() != 0.0
        monkeypatch.delenv(KEEP_ENV)
        assert flush_subnormals() and float32_product() == 0.0
        assert float(torch.exp(torch.tensor([-100.0])).item()) == 0.0        # Swin's mask: exp(s - 100)
        assert float((torch.tensor([TINY], dtype=torch.float64) * 3.0).item()) == 3 * TINY
        assert float(torch.exp(torch.tensor([-100.0], dtype=torch.float64)).item()) > 0.0
    finally:
        torch.set_flush_denormal(False)
