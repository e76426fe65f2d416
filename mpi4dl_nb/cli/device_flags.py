"""``--backend`` and ``--device`` on ``infer``'s own parser, and their check (train and evaluate take
``comm/device.DeviceChoice``); goes once ``infer`` generates its flags from its job."""
from __future__ import annotations

import argparse

from ..comm.device import BACKENDS, DEVICES, cuda_unavailable_reason
from ..config import ConfigError
from .job_flags import FlagAdder


def add_device_flags(parser: FlagAdder) -> None:
    """``--backend`` (the tensor data plane) and ``--device`` (where tensors live)."""
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="tensor data plane: mpi (mpi4py; CUDA-aware MPI or staged on GPU), "
                             "gloo (torch.distributed, CPU), nccl (torch.distributed, CUDA); "
                             "auto: nccl on GPU, mpi on CPU")
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="where tensors live: cuda (refused at once, naming what is missing, "
                             "when no GPU can be used), cpu, or auto (cuda when visible)")


def check_device_flags(args: argparse.Namespace) -> None:
    """ConfigError before any rank talks: a GPU asked for and not usable, gloo with CUDA tensors."""
    if args.device == "cuda" or args.backend == "nccl":
        missing = cuda_unavailable_reason()
        if missing is not None:
            flag, value = ("--device", "cuda") if args.device == "cuda" else ("--backend", "nccl")
            raise ConfigError(flag, f"{value} needs a CUDA GPU: {missing}; use --device cpu (or "
                                    f"auto) with --backend mpi or gloo")
    if args.backend == "gloo" and args.device == "cuda":
        raise ConfigError("--backend", "gloo moves CPU tensors; with --device cuda use --backend "
                                       "nccl or mpi")
