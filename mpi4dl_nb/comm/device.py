"""Node-local rank from the MPI launcher's environment, and the device a rank uses."""

from __future__ import annotations

import os
from collections.abc import Mapping

# Variables launchers set for the rank's index on its node, most specific first.
LOCAL_RANK_VARIABLES: tuple[tuple[str, str], ...] = (
    ("MV2_COMM_WORLD_LOCAL_RANK", "MVAPICH2"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI"),
    ("MPI_LOCALRANKID", "MPICH (hydra)"),
    ("PMI_LOCAL_RANK", "PMI/PMIx"),
    ("PALS_LOCAL_RANKID", "Cray PALS"),
    ("SLURM_LOCALID", "Slurm srun"),
    ("LOCAL_RANK", "torchrun"),
)


def local_rank_from_env(env: Mapping[str, str] | None = None) -> tuple[int, str] | None:
    """(local rank, launcher name) from the first launcher variable set, else None."""
    env = os.environ if env is None else env
    for name, launcher in LOCAL_RANK_VARIABLES:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value), launcher
            except ValueError as exc:
                raise ValueError(f"{name}={value!r} is not an integer local rank") from exc
    return None


def select_device(local_rank: int, cuda_count: int | None = None, prefer: str = "auto"):
    """``cuda:<local_rank % n_gpus>`` when CUDA is present (or asked for), else CPU."""
    import torch

    if prefer not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device preference {prefer!r}: use 'auto', 'cpu' or 'cuda'")
    if prefer == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if count > 0:
        return torch.device("cuda", local_rank % count)
    if prefer == "cuda":
        raise RuntimeError("device='cuda' was asked for but no CUDA device is visible; "
                           "use device='auto' or 'cpu'")
    return torch.device("cpu")
