"""The ``torch`` data plane: torch.distributed (gloo on CPU, nccl on GPU) bootstrapped from MPI."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .handles import Group, Request

if TYPE_CHECKING:
    from mpi4py import MPI
    from torch.distributed import ProcessGroup


def _store_address(control: MPI.Intracomm, local_size: int) -> str:
    """``tcp://host:port`` of the rendezvous store: rank 0 picks a free port, MPI tells everyone."""
    address = None
    if control.Get_rank() == 0:
        host = os.environ.get("MASTER_ADDR")
        if host is None:
            host = "127.0.0.1" if local_size == control.Get_size() else socket.gethostname()
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        address = f"tcp://{host}:{port}"
    return str(control.bcast(address, root=0))


class TorchPlane:
    """Tensors travel through torch.distributed; its process group is started from MPI.

    ``backend`` is ``gloo`` (CPU) or ``nccl`` (CUDA). The default process group is
    initialised once per process (a second plane reuses it); ``close`` destroys it.
    """

    name = "torch"
    cuda_aware = False   # a property of MPI libraries; nccl reads CUDA memory by itself

    def __init__(self, backend: str, device: torch.device, control: MPI.Intracomm,
                 local_size: int) -> None:
        self.backend = backend
        if not dist.is_initialized():
            address = _store_address(control, local_size)
            dist.init_process_group(backend, init_method=address, rank=control.Get_rank(),
                                    world_size=control.Get_size(),
                                    device_id=device if backend == "nccl" else None)

    # ------------------------------------------------------------ point to point
    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Request:
        return Request(_work(dist.isend(tensor.detach(), dst, tag=tag), "isend"), keep=tensor)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Request:
        return Request(_work(dist.irecv(tensor.detach(), src, tag=tag), "irecv"), keep=tensor)

    # --------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, group: Group) -> None:
        dist.all_reduce(tensor.detach(), group=group.torch_group)

    def broadcast(self, tensor: torch.Tensor, root: int, group: Group) -> None:
        dist.broadcast(tensor.detach(), src=root, group=group.torch_group)

    def process_group(self, ranks: Sequence[int] | None) -> ProcessGroup | None:
        if ranks is None:
            return dist.group.WORLD
        return dist.new_group(list(ranks))

    def close(self) -> None:
        """Tear down the torch.distributed process group (the MPI world stays up)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def _work(work: dist.Work | None, what: str) -> dist.Work:
    if work is None:   # torch returns None only to ranks outside the group
        raise RuntimeError(f"torch.distributed {what} returned no request: this rank is not "
                           f"in the default process group")
    return work
