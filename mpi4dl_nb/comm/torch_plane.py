"""The ``torch`` data plane: torch.distributed (gloo on CPU, nccl on GPU) bootstrapped from MPI.

Written to what NCCL supports, and run as is on gloo by the test suite:

* every exchange (a halo phase, a pipeline payload, its header) is posted as ONE
  ``torch.distributed.batch_isend_irecv`` group, so its sends and receives progress
  together (separate ``isend``/``irecv`` calls serialise on NCCL's stream and deadlock
  when both ranks of a pair receive first);
* no tags (NCCL ignores them; every op is posted with tag 0, on gloo too): between two
  ranks, messages of one process group match in the order they are posted. The layers
  above post in the same order on both sides by design (``architecture.md``, "Message
  order"): a halo phase carries at most one message per direction and pair, and pipeline
  payloads travel on one-way ``Channel`` groups whose receiver takes them in send order;
* only all-reduce, broadcast and batched p2p on tensors of the plane's device with
  dtypes NCCL has; object collectives and barriers go through MPI (the control plane).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .device import check_backend_device
from .handles import Channel, Group, Request, Transfer

if TYPE_CHECKING:
    from mpi4py import MPI

# dtypes NCCL reduces and moves (bool travels as uint8); no int16/uint16/complex
NCCL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                         torch.uint8, torch.int32, torch.int64, torch.bool})

# torch 2.14 names them ``*_single`` (the older names warn); torch 2.13 has the older ones only
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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
        check_backend_device(backend, device)
        self.backend = backend
        self.device = device
        if not dist.is_initialized():
            address = _store_address(control, local_size)
            dist.init_process_group(backend, init_method=address, rank=control.Get_rank(),
                                    world_size=control.Get_size(),
                                    device_id=device if backend == "nccl" else None)

    def _check(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != self.device.type:
            raise ValueError(f"the {self.backend} plane moves {self.device.type} tensors; got one on "
                             f"{tensor.device} (place tensors through ctx.device)")
        if self.backend == "nccl" and tensor.dtype not in NCCL_DTYPES:
            raise TypeError(f"NCCL cannot move {tensor.dtype} tensors; convert to one of "
                            f"{sorted(str(d) for d in NCCL_DTYPES)}")

    # ------------------------------------------------------------ point to point
    def exchange(self, transfers: Sequence[Transfer], via: Group | Channel | None) -> Request:
        """Post every transfer as one ``batch_isend_irecv`` group on ``via``'s process group."""
        if not transfers:
            return Request.completed()
        group = None if via is None else via.torch_group
        ops = []
        for t in transfers:
            self._check(t.tensor)
            ops.append(dist.P2POp(dist.isend if t.send else dist.irecv, t.tensor.detach(), t.peer,
                                  group=group, tag=0))
        works = dist.batch_isend_irecv(ops)
        return Request.all_of([w for w in works if w is not None],
                              keep=[t.tensor for t in transfers])

    # --------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, group: Group) -> None:
        self._check(tensor)
        dist.all_reduce(tensor.detach(), group=group.torch_group)

    def iall_reduce(self, tensor: torch.Tensor, group: Group) -> Request:
        """``all_reduce`` posted asynchronously (gloo runs it on its own threads, nccl on its stream)."""
        self._check(tensor)
        work = dist.all_reduce(tensor.detach(), group=group.torch_group, async_op=True)
        return Request.all_of([work] if work is not None else [], keep=tensor)

    def broadcast(self, tensor: torch.Tensor, root: int, group: Group) -> None:
        self._check(tensor)
        dist.broadcast(tensor.detach(), src=root, group=group.torch_group)

    def reduce_scatter(self, flat: torch.Tensor, out: torch.Tensor, counts: Sequence[int], group: Group) -> None:
        """torch's reduce-scatter of one tensor on the pieces padded to the widest (it takes even pieces only)."""
        self._check(flat)
        width = max(counts)
        padded = flat.new_zeros(width * len(counts))
        for member, (start, count) in enumerate(_pieces(counts)):
            padded[member * width:member * width + count] = flat[start:start + count]
        mine = flat.new_empty(width)
        _REDUCE_SCATTER(mine, padded, group=group.torch_group)
        out.copy_(mine[:out.numel()])

    def all_gather(self, piece: torch.Tensor, out: torch.Tensor, counts: Sequence[int], group: Group) -> None:
        """torch's all-gather into one tensor of the pieces padded to the widest, unpadded into ``out``."""
        self._check(piece)
        width = max(counts)
        mine = piece.new_zeros(width)
        mine[:piece.numel()] = piece
        padded = piece.new_empty(width * len(counts))
        _ALL_GATHER(padded, mine, group=group.torch_group)
        for member, (start, count) in enumerate(_pieces(counts)):
            out[start:start + count] = padded[member * width:member * width + count]

    # -------------------------------------------------------------------- groups
    def process_group(self, ranks: Sequence[int] | None) -> ProcessGroup | None:
        if ranks is None:
            return dist.group.WORLD
        return _member_group(dist.new_group(list(ranks)))

    def channel_group(self, src: int, dst: int) -> ProcessGroup | None:
        """A process group of its own for the one-way channel ``src -> dst`` (collective)."""
        return _member_group(dist.new_group(sorted((src, dst))))

    def close(self) -> None:
        """Tear down the torch.distributed process group (the MPI world stays up)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def _pieces(counts: Sequence[int]) -> list[tuple[int, int]]:
    """(start, count) of each member's piece of a flat tensor holding them one after another."""
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return list(zip(starts, counts))


def _member_group(group: ProcessGroup | int) -> ProcessGroup | None:
    """``new_group``'s result on this rank: the group, or None where this rank is not a member (torch gives
    ranks outside the group a sentinel number)."""
    return group if isinstance(group, ProcessGroup) else None
