"""The ``mpi`` data plane: mpi4py on the tensors' own memory (zero-copy on CPU, CUDA-aware MPI or staging on GPU)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .handles import Group, Request

if TYPE_CHECKING:
    from mpi4py import MPI
    from torch.distributed import ProcessGroup


def load_mpi() -> Any:
    """The ``mpi4py.MPI`` module (imported on first use: importing it starts MPI)."""
    from mpi4py import MPI

    return MPI


def cuda_aware_mpi() -> bool:
    """Whether the MPI library says it can read and write CUDA memory."""
    MPI = load_mpi()
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:  # noqa: BLE001 - an MPI without the extension
            pass
    return os.environ.get("MV2_USE_CUDA") == "1" or os.environ.get("MPI4DL_CUDA_AWARE") == "1"


class MpiPlane:
    """Tensors travel through mpi4py, on the tensors' own memory.

    CPU tensors go zero-copy (a NumPy view; bfloat16 as int16 bits). CUDA tensors go
    directly when the MPI library is CUDA-aware (MVAPICH2-GDR, CUDA-aware Open MPI; mpi4py
    reads ``__cuda_array_interface__``), else they are staged through host memory.

    Extension points for GPU work: every MPI call reaches a tensor's memory through
    ``_buffer`` (where a CUDA stream synchronisation before MPI belongs), and staging
    buffers come from ``_host_copy``/``_host_empty`` (where a pinned-buffer pool belongs).
    """

    name = "mpi"

    def __init__(self, comm: MPI.Comm, device: torch.device) -> None:
        self.comm = comm
        self.cuda_aware = device.type == "cuda" and cuda_aware_mpi()

    # ---------------------------------------------------------------- buffers
    def _buffer(self, tensor: torch.Tensor) -> Any:
        """The memory mpi4py reads/writes: the tensor's own where possible."""
        if tensor.device.type == "cpu":
            if tensor.dtype == torch.bfloat16:
                return tensor.detach().view(torch.int16).numpy()
            return tensor.detach().numpy()
        return tensor.detach()   # CUDA-aware MPI: mpi4py reads __cuda_array_interface__

    def _staged(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` must go through host memory (CUDA without CUDA-aware MPI)."""
        return tensor.device.type == "cuda" and not self.cuda_aware

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` to send or reduce from."""
        return tensor.detach().to("cpu")

    def _host_empty(self, like: torch.Tensor) -> torch.Tensor:
        """A pinned host buffer shaped like ``like`` to receive into."""
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)

    def _in_place(self, tensor: torch.Tensor, operation: Callable[[Any], object]) -> None:
        """Run a blocking in-place MPI ``operation(buffer)`` on ``tensor`` (staged if needed)."""
        if self._staged(tensor):
            host = self._host_copy(tensor)
            operation(self._buffer(host))
            tensor.detach().copy_(host)
        else:
            operation(self._buffer(tensor))

    # ------------------------------------------------------------ point to point
    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Request:
        source = self._host_copy(tensor) if self._staged(tensor) else tensor
        return Request(self.comm.Isend(self._buffer(source), dst, tag), keep=source)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Request:
        if not self._staged(tensor):
            return Request(self.comm.Irecv(self._buffer(tensor), src, tag), keep=tensor)
        host = self._host_empty(tensor)
        return Request(self.comm.Irecv(self._buffer(host), src, tag),
                       on_done=lambda: tensor.detach().copy_(host), keep=host)

    # --------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, group: Group) -> None:
        MPI = load_mpi()
        comm = group.communicator()
        self._in_place(tensor, lambda buffer: comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM))

    def broadcast(self, tensor: torch.Tensor, root: int, group: Group) -> None:
        comm, index = group.communicator(), group.rank_of(root)
        self._in_place(tensor, lambda buffer: comm.Bcast(buffer, root=index))

    def process_group(self, ranks: Sequence[int] | None) -> ProcessGroup | None:
        return None   # groups live in the MPI communicators the Context makes

    def close(self) -> None:
        """Nothing to tear down: the MPI world belongs to the process."""
