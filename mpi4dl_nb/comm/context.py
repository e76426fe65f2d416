"""Context: MPI bootstrap, process groups, and tensor p2p/collectives on two data planes.

The control plane is always mpi4py (ranks, object collectives, group bookkeeping).
Tensors travel on one of two data planes behind the same methods:

* ``mpi``   — mpi4py on the tensor's memory: zero-copy on CPU; on CUDA directly when
  the MPI library reports CUDA support (MVAPICH2-GDR, CUDA-aware Open MPI), else staged
  through a pinned host buffer.
* ``torch`` — torch.distributed, ``gloo`` on CPU or ``nccl`` on GPU, its TCP store
  address chosen by rank 0 and broadcast over MPI.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .device import local_rank_from_env, select_device
from .trace import Tracer

BACKENDS = ("auto", "mpi", "gloo", "nccl")


@dataclass
class Group:
    """A set of global ranks with its MPI communicator and (torch plane) process group."""

    ranks: tuple[int, ...]
    mpi_comm: Any = None      # mpi4py communicator, None on ranks outside the group
    torch_group: Any = None   # torch.distributed ProcessGroup, None on the mpi plane
    _index: dict[int, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._index = {r: i for i, r in enumerate(self.ranks)}

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_of(self, global_rank: int) -> int:
        """Index of ``global_rank`` inside the group."""
        try:
            return self._index[global_rank]
        except KeyError:
            raise ValueError(f"rank {global_rank} is not in group {self.ranks}") from None

    def __contains__(self, global_rank: object) -> bool:
        return global_rank in self._index


class Request:
    """A pending non-blocking send or receive; ``wait()`` completes it."""

    def __init__(self, handle: Any, on_done: Any = None, keep: Any = None) -> None:
        self._handle = handle
        self._on_done = on_done
        self._keep = keep          # buffers that must outlive the transfer
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self._handle.wait() if hasattr(self._handle, "wait") else self._handle.Wait()
        if self._on_done is not None:
            self._on_done()
        self.done = True
        self._keep = None


def _mpi():
    from mpi4py import MPI

    return MPI


def _cuda_aware_mpi() -> bool:
    """Whether the MPI library says it can read and write CUDA memory."""
    MPI = _mpi()
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:  # noqa: BLE001 - an MPI without the extension
            pass
    return os.environ.get("MV2_USE_CUDA") == "1" or os.environ.get("MPI4DL_CUDA_AWARE") == "1"


class Context:
    """One rank's view of the run: who it is, its device, and how it talks to the others."""

    def __init__(self, backend: str = "auto", device: str | torch.device = "auto",
                 comm: Any = None, trace: bool = True) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: use one of {', '.join(BACKENDS)}")
        MPI = _mpi()
        self.mpi_comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank: int = self.mpi_comm.Get_rank()
        self.world_size: int = self.mpi_comm.Get_size()
        shared = self.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_size: int = shared.Get_size()
        from_env = local_rank_from_env()
        self.local_rank: int = from_env[0] if from_env else shared.Get_rank()
        shared.Free()
        if isinstance(device, torch.device):
            self.device = device
        else:
            self.device = select_device(self.local_rank, prefer=str(device))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if backend == "auto":
            backend = "nccl" if self.device.type == "cuda" else "mpi"
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend 'nccl' needs a CUDA device; use backend='gloo' or 'mpi'")
        self.backend = backend
        self.plane = "mpi" if backend == "mpi" else "torch"
        self.cuda_aware = self.plane == "mpi" and self.device.type == "cuda" and _cuda_aware_mpi()
        if self.plane == "torch":
            self._init_torch_distributed()
        self.mpi_comm.Barrier()
        self.tracer = Tracer(self.rank, enabled=trace)
        self.world = Group(tuple(range(self.world_size)), self.mpi_comm,
                           None if self.plane == "mpi" else self._torch_world())

    # ----------------------------------------------------------------- bootstrap
    def _init_torch_distributed(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            return
        address = None
        if self.rank == 0:
            host = os.environ.get("MASTER_ADDR")
            if host is None:
                host = "127.0.0.1" if self.local_size == self.world_size else socket.gethostname()
            with socket.socket() as probe:
                probe.bind(("", 0))
                port = probe.getsockname()[1]
            address = f"tcp://{host}:{port}"
        address = self.mpi_comm.bcast(address, root=0)
        dist.init_process_group(self.backend, init_method=address, rank=self.rank,
                                world_size=self.world_size,
                                device_id=self.device if self.backend == "nccl" else None)

    def _torch_world(self) -> Any:
        import torch.distributed as dist

        return dist.group.WORLD

    def close(self) -> None:
        """Tear down the torch.distributed process group (the MPI world stays up)."""
        if self.plane == "torch":
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    # -------------------------------------------------------------------- groups
    def new_group(self, ranks: Iterable[int]) -> Group:
        """A group of ``ranks``; every rank of the world must call this in the same order."""
        ranks = tuple(int(r) for r in ranks)
        if len(set(ranks)) != len(ranks) or any(not 0 <= r < self.world_size for r in ranks):
            raise ValueError(f"group ranks {ranks} must be distinct ranks of a world of "
                             f"{self.world_size}")
        MPI = _mpi()
        mpi_group = self.mpi_comm.Get_group().Incl(list(ranks))
        sub = self.mpi_comm.Create(mpi_group)
        mpi_group.Free()
        torch_group = None
        if self.plane == "torch":
            import torch.distributed as dist

            torch_group = dist.new_group(list(ranks))
        return Group(ranks, sub if sub != MPI.COMM_NULL else None, torch_group)

    # ------------------------------------------------------------ point to point
    def _check(self, tensor: torch.Tensor, what: str) -> None:
        if not tensor.is_contiguous():
            raise ValueError(f"{what} needs a contiguous tensor (call .contiguous())")

    def _mpi_buffer(self, tensor: torch.Tensor) -> Any:
        """The buffer mpi4py reads/writes: the tensor's own memory where possible."""
        if tensor.device.type == "cpu":
            return tensor.detach().numpy() if tensor.dtype != torch.bfloat16 else \
                tensor.detach().view(torch.int16).numpy()
        return tensor.detach()  # CUDA-aware MPI: mpi4py reads __cuda_array_interface__

    def _staged(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda" and not self.cuda_aware

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Blocking send of a contiguous tensor to global rank ``dst``."""
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Blocking receive into ``tensor`` (contiguous) from global rank ``src``."""
        self.irecv(tensor, src, tag).wait()
        return tensor

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Request:
        """Start sending ``tensor``; keep it unchanged until ``wait()``."""
        self._check(tensor, "send")
        if self.plane == "torch":
            import torch.distributed as dist

            return Request(dist.isend(tensor.detach(), dst, tag=tag), keep=tensor)
        if self._staged(tensor):
            host = tensor.detach().to("cpu", non_blocking=False)
            return Request(self.mpi_comm.Isend(self._mpi_buffer(host), dst, tag), keep=host)
        return Request(self.mpi_comm.Isend(self._mpi_buffer(tensor), dst, tag), keep=tensor)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Request:
        """Start receiving into ``tensor``; its content is valid after ``wait()``."""
        self._check(tensor, "recv")
        if self.plane == "torch":
            import torch.distributed as dist

            return Request(dist.irecv(tensor.detach(), src, tag=tag), keep=tensor)
        if self._staged(tensor):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            handle = self.mpi_comm.Irecv(self._mpi_buffer(host), src, tag)
            return Request(handle, on_done=lambda: tensor.detach().copy_(host), keep=host)
        return Request(self.mpi_comm.Irecv(self._mpi_buffer(tensor), src, tag), keep=tensor)

    @staticmethod
    def wait_all(requests: Sequence[Request]) -> None:
        for request in requests:
            request.wait()

    # --------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, group: Group | None = None) -> torch.Tensor:
        """In-place sum of ``tensor`` over ``group`` (default: the world)."""
        group = self.world if group is None else group
        self._check(tensor, "all_reduce")
        if group.size == 1:
            return tensor
        if self.plane == "torch":
            import torch.distributed as dist

            dist.all_reduce(tensor.detach(), group=group.torch_group)
            return tensor
        MPI = _mpi()
        if self._staged(tensor):
            host = tensor.detach().cpu()
            group.mpi_comm.Allreduce(MPI.IN_PLACE, self._mpi_buffer(host), op=MPI.SUM)
            tensor.detach().copy_(host)
        else:
            group.mpi_comm.Allreduce(MPI.IN_PLACE, self._mpi_buffer(tensor), op=MPI.SUM)
        return tensor

    def broadcast(self, tensor: torch.Tensor, root: int, group: Group | None = None) -> torch.Tensor:
        """Overwrite ``tensor`` on every member of ``group`` with global rank ``root``'s copy."""
        group = self.world if group is None else group
        self._check(tensor, "broadcast")
        if group.size == 1:
            return tensor
        if self.plane == "torch":
            import torch.distributed as dist

            dist.broadcast(tensor.detach(), src=root, group=group.torch_group)
            return tensor
        index = group.rank_of(root)
        if self._staged(tensor):
            host = tensor.detach().cpu()
            group.mpi_comm.Bcast(self._mpi_buffer(host), root=index)
            tensor.detach().copy_(host)
        else:
            group.mpi_comm.Bcast(self._mpi_buffer(tensor), root=index)
        return tensor

    def barrier(self, group: Group | None = None) -> None:
        group = self.world if group is None else group
        group.mpi_comm.Barrier()

    def all_gather_object(self, obj: Any, group: Group | None = None) -> list[Any]:
        group = self.world if group is None else group
        return group.mpi_comm.allgather(obj)

    def bcast_object(self, obj: Any, root: int = 0, group: Group | None = None) -> Any:
        group = self.world if group is None else group
        return group.mpi_comm.bcast(obj, root=group.rank_of(root))

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        return self.mpi_comm.gather(obj, root=root)

    def scatter_object(self, pieces: Sequence[Any] | None, root: int = 0) -> Any:
        """Rank ``root`` gives ``pieces[r]`` to each rank r (``pieces`` ignored elsewhere)."""
        return self.mpi_comm.scatter(pieces, root=root)

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (after an unrecoverable error on this one)."""
        self.mpi_comm.Abort(code)

    def __repr__(self) -> str:
        return (f"Context(rank={self.rank}, world_size={self.world_size}, "
                f"local_rank={self.local_rank}, device={self.device}, backend={self.backend!r})")


_CURRENT: Context | None = None


def init(backend: str = "auto", device: str | torch.device = "auto", *, threads: int | None = None,
         tune_malloc: bool = True, trace: bool = True) -> Context:
    """Start (or return) this process's Context from MPI.

    ``backend``: ``auto`` (``mpi`` on CPU, ``nccl`` on GPU), ``mpi``, ``gloo`` or ``nccl``.
    ``threads``: torch threads per rank; default splits the node's cores among its ranks.
    ``tune_malloc``: keep freed large CPU buffers in the process (glibc mallopt), which
    spares page faults on every step of large CPU activations.
    """
    global _CURRENT
    if _CURRENT is not None:
        if backend not in ("auto", _CURRENT.backend):
            raise RuntimeError(f"already initialised with backend {_CURRENT.backend!r}; "
                               f"asked for {backend!r} (one backend per process)")
        return _CURRENT
    ctx = Context(backend=backend, device=device, trace=trace)
    if threads is None and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // ctx.local_size)
    if threads is not None:
        torch.set_num_threads(threads)
    if tune_malloc and ctx.device.type == "cpu":
        from .allocator import tune_malloc as _tune

        _tune()
    _CURRENT = ctx
    return ctx


def current() -> Context | None:
    """The Context made by ``init`` in this process, if any."""
    return _CURRENT
