"""Context: MPI bootstrap, process groups, and tensor p2p/collectives on two data planes.

The control plane is always mpi4py (ranks, object collectives, group bookkeeping).
Tensors travel on one of two data planes behind the same methods (``protocol.DataPlane``):

* ``mpi``   — ``MpiPlane``: mpi4py on the tensor's memory: zero-copy on CPU; on CUDA
  directly when the MPI library reports CUDA support (MVAPICH2-GDR, CUDA-aware Open MPI),
  else staged through reusable pinned host buffers; the current stream is waited for
  before MPI touches device memory.
* ``torch`` — ``TorchPlane``: torch.distributed, ``gloo`` on CPU or ``nccl`` on GPU, its TCP
  store address chosen by rank 0 and broadcast over MPI; every exchange is one
  ``batch_isend_irecv`` group and messages match by posting order, not tags.

Groups and channels are cached: asking again for the same ranks returns the same object
(all ranks ask in the same order, so all hit or all miss), so building engines again and
again in one process does not pile up communicators.

Small host tensors that say what is coming (a pipeline payload's header) go on the control
plane (``exchange_host``): MPI on a communicator of their own, duplicated from the world at
construction, never through a device, so reading one waits for no kernel.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from .device import BACKENDS, bind_launcher_device, check_backend_device, local_rank_from_env, plane_for, select_device
from .handles import Channel, Group, Request, Transfer
from .mpi_plane import MpiPlane, MpiRequests
from .node_sum import NodeSum
from .trace import DEFAULT_MAX_EVENTS, DEFAULT_WINDOW_STEPS, CudaClock, Tracer
from .waiting import WaitMode, wait_mode_for

if TYPE_CHECKING:
    from mpi4py import MPI

    from .protocol import DataPlane

__all__ = ["BACKENDS", "Channel", "Context", "Group", "Request", "Transfer", "abort_job", "current", "init"]

T = TypeVar("T")   # a picklable object an object collective carries

OUTPUT_FORWARD_SECONDS = 0.5   # before an abort: the launcher forwards what the rank just wrote


def abort_job(mpi_comm: MPI.Comm, code: int) -> None:
    """End every rank of ``mpi_comm``'s job with ``code``, once the launcher had time to forward output.

    ``mpiexec`` (Hydra) handles the abort and the rank's output on separate channels; an abort
    right after a message lost the message now and then (5 of 40 tries on this machine; 0 of 40
    with 0.1 s), so the last words of a failing job wait half a second before the abort.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(OUTPUT_FORWARD_SECONDS)
    mpi_comm.Abort(code)


def _require_contiguous(tensor: torch.Tensor, what: str) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{what} needs a contiguous tensor (call .contiguous())")


def _check_counts(flat: torch.Tensor, counts: Sequence[int], group: Group, what: str) -> None:
    _require_contiguous(flat, what)
    if len(counts) != group.size or flat.dim() != 1 or flat.numel() != sum(counts):
        raise ValueError(f"{what}: a flat tensor of {flat.numel()} elements does not hold the pieces {list(counts)} "
                         f"of the {group.size} members {group.ranks}")


class Context:
    """One rank's view of the run: who it is, its device, and how it talks to the others.

    Implements ``protocol.Comm``; tensors go through ``data_plane`` (``MpiPlane`` or
    ``TorchPlane``), everything else through the MPI communicator ``mpi_comm``.
    """

    def __init__(self, backend: str = "auto", device: str | torch.device = "auto",
                 comm: MPI.Intracomm | None = None, trace: bool = True, *,
                 trace_window: int | None = DEFAULT_WINDOW_STEPS,
                 trace_max_events: int | None = DEFAULT_MAX_EVENTS, wait: str | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: use one of {', '.join(BACKENDS)}")
        if not isinstance(device, torch.device):
            bind_launcher_device(str(device))   # the rank's GPU current before MPI starts (it may open a context)
        from mpi4py import MPI as mpi  # imported on first use: importing it starts MPI

        self.mpi_comm: MPI.Intracomm = comm if comm is not None else mpi.COMM_WORLD
        self.rank: int = self.mpi_comm.Get_rank()
        self.world_size: int = self.mpi_comm.Get_size()
        shared = self.mpi_comm.Split_type(mpi.COMM_TYPE_SHARED, key=self.rank)
        self.local_size: int = shared.Get_size()
        from_env = local_rank_from_env()
        self.local_rank: int = from_env[0] if from_env else shared.Get_rank()
        shared.Free()
        self.wait_mode: WaitMode = wait_mode_for(self.local_size, requested=wait)
        if isinstance(device, torch.device):
            self.device = device
        else:
            self.device = select_device(self.local_rank, prefer=str(device))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        backend = self._choose_plane(backend)
        if backend != "mpi":
            check_backend_device(backend, self.device)
        self.backend = backend
        self.data_plane: DataPlane = self._start_plane(backend)
        self.mpi_comm.Barrier()
        origin = time.perf_counter()   # CUDA events time kernels on GPU, host stamps on CPU
        clock = CudaClock(self.device, origin) if self.device.type == "cuda" else None
        self.tracer = Tracer(self.rank, enabled=trace, origin=origin, window_steps=trace_window,
                             max_events=trace_max_events, clock=clock)
        self.world = Group(tuple(range(self.world_size)), self.mpi_comm,
                           self.data_plane.process_group(None))
        self._host_comm: MPI.Intracomm = self.mpi_comm.Dup()   # exchange_host's own: posting order per pair
        self._groups: dict[tuple[int, ...], Group] = {}
        self._channels: dict[tuple[int, int], Channel] = {}
        self._node_sums: dict[tuple[int, ...], NodeSum | None] = {}

    def _choose_plane(self, backend: str) -> str:
        """``backend`` resolved for the job's most crowded node (``device.plane_for``; every rank alike), said on
        rank 0 where ``auto`` leaves NCCL out because ranks share a GPU."""
        gpus = torch.cuda.device_count() if self.device.type == "cuda" else 0
        local, gpus = max(self.mpi_comm.allgather((self.local_size, gpus)), key=lambda node: node[0] - node[1])
        chosen = plane_for(backend, self.device, local, gpus)
        if backend == "auto" and self.device.type == "cuda" and chosen == "mpi" and self.rank == 0:
            print(f"--backend auto: the mpi plane ({local} ranks share {gpus} GPU(s) on a node; NCCL needs a GPU "
                  f"per rank)", file=sys.stderr, flush=True)
        return chosen

    def _start_plane(self, backend: str) -> DataPlane:
        if backend == "mpi":
            return MpiPlane(self.mpi_comm, self.device, wait_mode=self.wait_mode)
        from .torch_plane import TorchPlane

        return TorchPlane(backend, self.device, self.mpi_comm, self.local_size)

    @property
    def plane(self) -> str:
        """Name of the data plane: ``mpi`` or ``torch``."""
        return self.data_plane.name

    @property
    def cuda_aware(self) -> bool:
        """Whether CUDA tensors go to MPI directly (mpi plane with a CUDA-aware MPI)."""
        return self.data_plane.cuda_aware

    def close(self) -> None:
        """Tear down the data plane (torch.distributed's process group; the MPI world stays up)."""
        self.data_plane.close()

    # -------------------------------------------------------------------- groups
    def new_group(self, ranks: Iterable[int]) -> Group:
        """The group of ``ranks`` (in that order); every rank of the world must call this in the
        same order. Asking again for the same ranks returns the same (cached) group."""
        members = tuple(int(r) for r in ranks)
        if len(set(members)) != len(members) or any(not 0 <= r < self.world_size for r in members):
            raise ValueError(f"group ranks {members} must be distinct ranks of a world of "
                             f"{self.world_size}")
        cached = self._groups.get(members)
        if cached is not None:
            return cached
        mpi_group = self.mpi_comm.Get_group().Incl(list(members))
        sub = self.mpi_comm.Create(mpi_group)
        mpi_group.Free()
        from mpi4py import MPI as mpi

        group = Group(members, sub if sub != mpi.COMM_NULL else None,
                      self.data_plane.process_group(members))
        self._groups[members] = group
        return group

    def private_group(self, group: Group | None = None) -> Group | None:
        """``group`` (None: the world) on an MPI communicator of its own, not cached: its collectives never match
        another route's, whatever order the members post them in relative to those. Collective over ``group``'s
        members only. None on the torch plane, whose process groups every rank of the world must create."""
        if self.data_plane.name != "mpi":
            return None
        group = self.world if group is None else group
        return Group(group.ranks, group.communicator().Dup(), None)

    def node_sum(self, group: Group | None = None) -> NodeSum | None:
        """Sums over ``group`` (None: the world) through its node's shared memory (``node_sum.NodeSum``), made once
        per group; None on the torch plane (its tensors go through torch.distributed) or where the members span
        nodes. Collective over ``group``'s members the first time."""
        group = self.world if group is None else group
        if self.data_plane.name != "mpi":
            return None
        if group.ranks not in self._node_sums:
            self._node_sums[group.ranks] = NodeSum.open(group.communicator(), self.wait_mode)
        return self._node_sums[group.ranks]

    def channels(self, pairs: Iterable[tuple[int, int]]) -> dict[tuple[int, int], Channel]:
        """The one-way channels ``src -> dst`` of ``pairs``; collective: every rank of the world
        passes the same pairs in the same order. Cached like groups."""
        out: dict[tuple[int, int], Channel] = {}
        for src, dst in pairs:
            key = (int(src), int(dst))
            if key[0] == key[1] or any(not 0 <= r < self.world_size for r in key):
                raise ValueError(f"channel {key[0]} -> {key[1]} must join two distinct ranks of a "
                                 f"world of {self.world_size}")
            channel = self._channels.get(key)
            if channel is None:
                channel = Channel(*key, self.data_plane.channel_group(*key))
                self._channels[key] = channel
            out[key] = channel
        return out

    @property
    def cached_groups(self) -> int:
        """Groups and channels this context has made (each once)."""
        return len(self._groups) + len(self._channels)

    # ------------------------------------------------------------ point to point
    def exchange(self, transfers: Sequence[Transfer], via: Group | Channel | None = None) -> Request:
        """Post ``transfers`` (sends and receives) as one exchange; ``wait()`` completes them all.

        The torch plane posts them as one ``batch_isend_irecv`` group on ``via``'s process
        group (None: the world) and ignores tags: messages between two ranks on one route
        match in posting order, so both sides must post them in the same order. The mpi
        plane matches by (source, tag) on the world communicator.
        """
        for t in transfers:
            _require_contiguous(t.tensor, "send" if t.send else "recv")
        return self.data_plane.exchange(transfers, via)

    def exchange_host(self, transfers: Sequence[Transfer]) -> Request:
        """Post host-memory ``transfers`` (a payload's header) on the control plane: MPI on a communicator of
        their own, where the messages between two ranks match in the order they are posted (tags unused, as on the
        torch plane). No device is involved on either plane, so neither side waits for a kernel."""
        for t in transfers:
            _require_contiguous(t.tensor, "exchange_host")
            if t.tensor.device.type != "cpu":
                raise ValueError(f"exchange_host moves host tensors; got one on {t.tensor.device} (use exchange)")
        comm = self._host_comm
        handles = [comm.Isend(t.tensor.detach(), t.peer, 0) if t.send else comm.Irecv(t.tensor.detach(), t.peer, 0)
                   for t in transfers]
        return Request(MpiRequests(handles, self.wait_mode), keep=[t.tensor for t in transfers])

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Blocking send of a contiguous tensor to global rank ``dst``."""
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Blocking receive into ``tensor`` (contiguous) from global rank ``src``."""
        self.irecv(tensor, src, tag).wait()
        return tensor

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Request:
        """Start sending ``tensor``; keep it unchanged until ``wait()`` (tag: mpi plane only)."""
        return self.exchange([Transfer.to(tensor, dst, tag)])

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Request:
        """Start receiving into ``tensor``; its content is valid after ``wait()`` (tag: mpi plane only)."""
        return self.exchange([Transfer.into(tensor, src, tag)])

    @staticmethod
    def wait_all(requests: Sequence[Request]) -> None:
        for request in requests:
            request.wait()

    # --------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, group: Group | None = None) -> torch.Tensor:
        """In-place sum of ``tensor`` over ``group`` (default: the world)."""
        group = self.world if group is None else group
        _require_contiguous(tensor, "all_reduce")
        if group.size > 1:
            self.data_plane.all_reduce(tensor, group)
        return tensor

    def iall_reduce(self, tensor: torch.Tensor, group: Group | None = None) -> Request:
        """Post an in-place sum of ``tensor`` over ``group`` (default: the world); the sum is there after
        ``wait()``. Every member posts its non-blocking reductions of one group in the same order."""
        group = self.world if group is None else group
        _require_contiguous(tensor, "iall_reduce")
        if group.size > 1:
            return self.data_plane.iall_reduce(tensor, group)
        return Request.completed()

    def broadcast(self, tensor: torch.Tensor, root: int, group: Group | None = None) -> torch.Tensor:
        """Overwrite ``tensor`` on every member of ``group`` with global rank ``root``'s copy."""
        group = self.world if group is None else group
        _require_contiguous(tensor, "broadcast")
        if group.size > 1:
            self.data_plane.broadcast(tensor, root, group)
        return tensor

    def reduce_scatter(self, flat: torch.Tensor, counts: Sequence[int], group: Group | None = None) -> torch.Tensor:
        """The sum of ``flat`` over ``group`` (default: the world), cut into the members' pieces (``counts[i]``
        elements for member ``i``, in member order; uneven allowed): this rank's piece, a new tensor."""
        group = self.world if group is None else group
        _check_counts(flat, counts, group, "reduce_scatter")
        index = group.rank_of(self.rank)
        if group.size == 1:
            return flat.detach().clone()
        out = flat.new_empty(counts[index])
        self.data_plane.reduce_scatter(flat.detach(), out, counts, group)
        return out

    def all_gather(self, piece: torch.Tensor, counts: Sequence[int], group: Group | None = None) -> torch.Tensor:
        """Every member's ``piece`` (``counts[i]`` elements from member ``i``, uneven allowed) one after another."""
        group = self.world if group is None else group
        _require_contiguous(piece, "all_gather")
        if len(counts) != group.size or piece.numel() != counts[group.rank_of(self.rank)]:
            raise ValueError(f"all_gather: {piece.numel()} elements for counts {list(counts)} over {group.ranks}")
        if group.size == 1:
            return piece.detach().reshape(-1).clone()
        out = piece.new_empty(sum(counts))
        self.data_plane.all_gather(piece.detach().reshape(-1), out, counts, group)
        return out

    def barrier(self, group: Group | None = None) -> None:
        comm = (self.world if group is None else group).communicator()
        MpiRequests([comm.Ibarrier()], self.wait_mode).wait()

    def _all_arrived(self, group: Group | None) -> MPI.Comm:
        """``group``'s communicator, once every member got here. The object collectives below
        are the library's blocking ones, which poll a core while a member is late; in
        ``WaitMode.YIELD`` the ranks first meet at a barrier in the wait mode (sleeping), so
        the collective then finds everyone there."""
        comm = (self.world if group is None else group).communicator()
        if self.wait_mode is WaitMode.YIELD and comm.Get_size() > 1:
            MpiRequests([comm.Ibarrier()], self.wait_mode).wait()
        return comm

    def all_gather_object(self, obj: T, group: Group | None = None) -> list[T]:
        return self._all_arrived(group).allgather(obj)

    def bcast_object(self, obj: T, root: int = 0, group: Group | None = None) -> T:
        group = self.world if group is None else group
        return self._all_arrived(group).bcast(obj, root=group.rank_of(root))

    def gather_object(self, obj: T, root: int = 0) -> list[T] | None:
        return self._all_arrived(None).gather(obj, root=root)

    def scatter_object(self, pieces: Sequence[T] | None, root: int = 0) -> T:
        """Rank ``root`` gives ``pieces[r]`` to each rank r (``pieces`` ignored elsewhere)."""
        return self._all_arrived(None).scatter(pieces, root=root)

    def abort(self, code: int = 1) -> None:
        """End every rank of the job (after an unrecoverable error on this one; output written before is kept)."""
        abort_job(self.mpi_comm, code)

    def __repr__(self) -> str:
        return (f"Context(rank={self.rank}, world_size={self.world_size}, "
                f"local_rank={self.local_rank}, device={self.device}, backend={self.backend!r})")


_CURRENT: Context | None = None


def init(backend: str = "auto", device: str | torch.device = "auto", *, threads: int | None = None,
         tune_malloc: bool = True, flush_subnormals: bool = True, trace: bool = True,
         trace_window: int | None = DEFAULT_WINDOW_STEPS,
         trace_max_events: int | None = DEFAULT_MAX_EVENTS, wait: str | None = None) -> Context:
    """Start (or return) this process's Context from MPI.

    ``backend``: ``auto`` (``nccl`` with a GPU per rank, else ``mpi``), ``mpi``, ``gloo`` (CPU) or
    ``nccl`` (CUDA, a GPU per rank). ``device``: ``auto`` (CUDA when visible), ``cpu`` or ``cuda`` (refused
    at once, naming what is missing, when no CUDA device can be used).
    ``trace_window``: steps whose events the trace keeps (None: every event, unbounded);
    ``trace_max_events``: cap on kept events (None: none).
    ``wait``: how the mpi plane waits, ``auto`` (default; ``yield`` when the node's ranks
    outnumber its cores), ``block`` or ``yield`` (``comm/waiting.py``; None: the
    ``MPI4DL_NB_WAIT`` environment variable, else auto).
    ``threads``: torch threads per rank; default splits the node's cores among its ranks.
    ``tune_malloc``: keep freed large CPU buffers in the process (glibc mallopt), which
    spares page faults on every step of large CPU activations.
    ``flush_subnormals``: on CPU, compute subnormal floats as zeros, as GPUs' kernels do
    (``comm/cpu_floats.py``: Swin's masked windows no longer slow the tile attending them).
    """
    global _CURRENT
    if _CURRENT is not None:
        if backend not in ("auto", _CURRENT.backend):
            raise RuntimeError(f"already initialised with backend {_CURRENT.backend!r}; "
                               f"asked for {backend!r} (one backend per process)")
        return _CURRENT
    ctx = Context(backend=backend, device=device, trace=trace, trace_window=trace_window,
                  trace_max_events=trace_max_events, wait=wait)
    if threads is None and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // ctx.local_size)
    if threads is not None:
        torch.set_num_threads(threads)
    if tune_malloc and ctx.device.type == "cpu":
        from .allocator import tune_malloc as _tune

        _tune()
    if flush_subnormals and ctx.device.type == "cpu":
        from .cpu_floats import flush_subnormals as _flush

        _flush()
    _CURRENT = ctx
    return ctx


def current() -> Context | None:
    """The Context made by ``init`` in this process, if any."""
    return _CURRENT
