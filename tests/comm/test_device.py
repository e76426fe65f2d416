"""Device choice from each MPI launcher's local-rank variable, with a faked environment."""

import pytest
import torch

from mpi4dl_nb.comm.device import local_rank_from_env, select_device


@pytest.mark.parametrize("env, expected", [
    ({"MPI_LOCALRANKID": "3"}, (3, "MPICH (hydra)")),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}, (1, "Open MPI")),
    ({"MV2_COMM_WORLD_LOCAL_RANK": "2"}, (2, "MVAPICH2")),
    ({"SLURM_LOCALID": "5"}, (5, "Slurm srun")),
    ({"MV2_COMM_WORLD_LOCAL_RANK": "2", "SLURM_LOCALID": "0"}, (2, "MVAPICH2")),
    ({}, None),
])
def test_local_rank_from_launchers(env, expected):
    assert local_rank_from_env(env) == expected


def test_bad_local_rank_value():
    with pytest.raises(ValueError, match="SLURM_LOCALID='x'"):
        local_rank_from_env({"SLURM_LOCALID": "x"})


@pytest.mark.parametrize("local_rank, gpus, expected", [
    (0, 4, "cuda:0"), (5, 4, "cuda:1"), (3, 0, "cpu"), (2, 2, "cuda:0")])
def test_device_from_local_rank(local_rank, gpus, expected):
    assert select_device(local_rank, cuda_count=gpus) == torch.device(expected)


def test_device_preferences():
    assert select_device(1, cuda_count=8, prefer="cpu") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        select_device(0, cuda_count=0, prefer="cuda")
    with pytest.raises(ValueError, match="use 'auto'"):
        select_device(0, prefer="tpu")


def test_slurm_env_reaches_context_device(monkeypatch):
    """The Context uses the launcher variable, not its own guess, for the local rank."""
    from mpi4dl_nb.comm.context import Context

    monkeypatch.setenv("SLURM_LOCALID", "3")
    for name in ("MV2_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                 "PMI_LOCAL_RANK", "PALS_LOCAL_RANKID"):
        monkeypatch.delenv(name, raising=False)
    ctx = Context(backend="mpi")
    assert ctx.local_rank == 3
    assert ctx.device == select_device(3)
