"""The CPU ranks' malloc settings (freed blocks kept, never trimmed) go to CPU ranks only: not to ranks of a
node with a usable GPU, launched by ``mpiexec`` or as notebook engines."""

from __future__ import annotations

import pytest

from mpi4dl_nb.comm import device
from mpi4dl_nb.comm.launcher import CPU_MALLOC_ENV, rank_environment
from mpi4dl_nb.notebook.engine_launch import engine_env


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu node", "cpu node"])
def test_malloc_tuning_only_for_cpu_ranks(monkeypatch: pytest.MonkeyPatch, gpu: bool) -> None:
    monkeypatch.setattr(device, "cuda_unavailable_reason", lambda: None if gpu else "no GPU is visible")
    for env in (rank_environment(2, base={}), engine_env(n=2)):
        assert env["OMP_NUM_THREADS"] == "1"
        assert all((name in env) is not gpu for name in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")), env
    assert CPU_MALLOC_ENV.items() <= rank_environment(2, base={}, gpus=False).items()
    assert not CPU_MALLOC_ENV.keys() & rank_environment(2, base={}, gpus=True).keys()
