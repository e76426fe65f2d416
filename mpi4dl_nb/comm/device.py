"""Node-local rank from the MPI launcher's environment, the device and data plane a run asks for (DeviceChoice:
``--device``, ``--backend``), the device a rank uses (and the tensor backends that fit it), and waiting for it."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..schema import flag

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "mpi", "gloo", "nccl")
BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}   # torch.distributed backends and their tensors
DEVICE_GROUP = "device"


@dataclass(frozen=True)
class DeviceChoice:
    """Where a run's tensors live and which data plane moves them (``--device``, ``--backend``; train, evaluate,
    infer)."""

    backend: str = flag("--backend", "tensor data plane: mpi (mpi4py; CUDA-aware MPI or staged on GPU), gloo "
                                     "(torch.distributed, CPU), nccl (torch.distributed, CUDA); auto: nccl with a "
                                     "GPU per rank, else mpi", "auto", choices=BACKENDS, group=DEVICE_GROUP)
    device: str = flag("--device", "where tensors live: cuda (refused at once, naming what is missing, when no GPU "
                                   "can be used), cpu, or auto (cuda when visible)", "auto", choices=DEVICES,
                       group=DEVICE_GROUP)

    def check(self) -> None:
        """ConfigError before any rank talks: a GPU asked for and not usable, gloo with CUDA tensors."""
        if self.device == "cuda" or self.backend == "nccl":
            missing = cuda_unavailable_reason()
            if missing is not None:
                knob, value = ("--device", "cuda") if self.device == "cuda" else ("--backend", "nccl")
                raise ConfigError(knob, f"{value} needs a CUDA GPU: {missing}; use --device cpu (or auto) with "
                                        f"--backend mpi or gloo")
        if self.backend == "gloo" and self.device == "cuda":
            raise ConfigError("--backend", "gloo moves CPU tensors; with --device cuda use --backend nccl or mpi")

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


def cuda_unavailable_reason() -> str | None:
    """Why this process cannot use a CUDA device (None: it can), naming what is missing."""
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (f"this torch ({torch.__version__}) was built without CUDA; install a CUDA build of "
                f"torch (see docs/setup.md, TORCH_SPEC/TORCH_INDEX)")
    if torch.cuda.device_count() == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = f" with CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        return (f"torch {torch.__version__} has CUDA {torch.version.cuda} but no CUDA device is "
                f"visible{hidden}; check the driver (nvidia-smi) and the job's GPU allocation")
    return None


def select_device(local_rank: int, cuda_count: int | None = None, prefer: str = "auto") -> torch.device:
    """``cuda:<local_rank % n_gpus>`` when CUDA is present (or asked for), else CPU."""
    import torch

    if prefer not in DEVICES:
        raise ValueError(f"device preference {prefer!r}: use 'auto', 'cpu' or 'cuda'")
    if prefer == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if count > 0:
        return torch.device("cuda", local_rank % count)
    if prefer == "cuda":
        reason = cuda_unavailable_reason() if cuda_count is None else None
        raise RuntimeError(f"device='cuda' was asked for but no CUDA device can be used: "
                           f"{reason or 'no CUDA device is visible'}; use device='auto' or 'cpu'")
    return torch.device("cpu")


def plane_for(backend: str, device: torch.device, local_ranks: int, gpus: int) -> str:
    """The data plane ``backend`` names on ``device`` with ``local_ranks`` ranks on a node of ``gpus`` GPUs: ``auto`` is
    nccl only with a GPU per rank (NCCL stops at "Duplicate GPU detected"), else mpi; nccl on shared GPUs is refused."""
    shared = device.type == "cuda" and local_ranks > gpus
    if backend == "nccl" and shared:
        raise ConfigError("--backend", f"nccl needs a GPU per rank: {local_ranks} ranks share {gpus} GPU(s) on a node; "
                                       f"use --backend mpi")
    if backend == "auto":
        return "nccl" if device.type == "cuda" and not shared else "mpi"
    return backend


def requested_device(argv: Sequence[str]) -> str:
    """The ``--device`` value of a command line (``auto`` when absent)."""
    for i, arg in enumerate(argv):
        if arg.startswith("--device="):
            return arg.split("=", 1)[1]
        if arg == "--device" and i + 1 < len(argv):
            return argv[i + 1]
    return "auto"


def bind_launcher_device(prefer: str = "auto", env: Mapping[str, str] | None = None) -> torch.device | None:
    """Make the GPU of the launcher's local rank current before MPI starts (an MPI that opens a CUDA context at init,
    MVAPICH2-GDR or a CUDA build of MPICH, opens it on the current GPU: GPU 0 in every rank otherwise); None (nothing
    done) on CPU, without a launcher's local rank, or once MPI has started."""
    found = local_rank_from_env(env)
    if prefer == "cpu" or found is None or "mpi4py.MPI" in sys.modules:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    device = select_device(found[0], torch.cuda.device_count(), prefer="cuda")
    torch.cuda.set_device(device)
    return device


def synchronize(device: torch.device) -> None:
    """Wait for every kernel queued on ``device`` (all streams, NCCL's too; no-op off CUDA): before a host clock
    reading that must include them."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def check_backend_device(backend: str, device: torch.device) -> None:
    """ValueError unless ``backend`` moves tensors of ``device`` (gloo: CPU, nccl: CUDA)."""
    wanted = BACKEND_DEVICE.get(backend)
    if wanted is None:
        raise ValueError(f"torch plane backend {backend!r}: use 'gloo' (CPU) or 'nccl' (CUDA)")
    if device.type != wanted:
        other = "nccl" if backend == "gloo" else "gloo"
        raise ValueError(f"backend {backend!r} moves {wanted.upper()} tensors but this rank's device "
                         f"is {device}; use backend {other!r} or 'mpi', or device {wanted!r}")


def settle(device: torch.device) -> None:
    """Wait for the kernels queued on ``device``'s current stream (no-op off CUDA).

    Needed before a library outside CUDA's stream order (MPI) reads or writes device
    memory that kernels (e.g. an asynchronous copy into a halo buffer) may still touch.
    """
    if device.type == "cuda":
        import torch

        torch.cuda.current_stream(device).synchronize()
