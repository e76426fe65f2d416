"""The typed seams of the communication layer: ``Comm`` (what the layers above need) and ``DataPlane``.

``Comm`` is everything spatial/, pipeline/ and run/ ask of a rank's context: who it is, its
device and tracer, tensor point to point and collectives, groups and object collectives.
``Context`` is the implementation; a test may pass any object with these members.

``DataPlane`` is how tensors travel under a ``Context``: ``MpiPlane`` (mpi4py on the
tensors' memory) or ``TorchPlane`` (torch.distributed gloo/nccl). The control plane
(ranks, groups' MPI communicators, object collectives, barriers) is always mpi4py and
stays in ``Context``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from .handles import Channel, Group, Request, Transfer
from .trace import Tracer

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

T = TypeVar("T")   # a picklable object an object collective carries


class Comm(Protocol):
    """One rank's communication context as the layers above ``comm`` use it.

    Ranks are global; ``group=None`` means the world; ``root`` is a global rank.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def tracer(self) -> Tracer: ...

    # point to point (contiguous tensors)
    def exchange(self, transfers: Sequence[Transfer], via: Group | Channel | None = None) -> Request:
        """Post a set of sends and receives as one exchange (one NCCL group on the torch plane)."""
        ...

    def exchange_host(self, transfers: Sequence[Transfer]) -> Request:
        """Post host tensors (a payload's header) on the control plane, matched per pair in posting order."""
        ...

    def channels(self, pairs: Iterable[tuple[int, int]]) -> dict[tuple[int, int], Channel]:
        """The one-way channels ``src -> dst`` of ``pairs`` (collective: same pairs on every rank)."""
        ...

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Request: ...

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Request: ...

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None: ...

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor: ...

    def wait_all(self, requests: Sequence[Request]) -> None: ...

    # tensor collectives (in place)
    def all_reduce(self, tensor: torch.Tensor, group: Group | None = None) -> torch.Tensor: ...

    def iall_reduce(self, tensor: torch.Tensor, group: Group | None = None) -> Request:
        """Post an in-place sum of ``tensor`` over ``group``; its value is the sum after ``wait()``."""
        ...

    def broadcast(self, tensor: torch.Tensor, root: int, group: Group | None = None) -> torch.Tensor: ...

    def reduce_scatter(self, flat: torch.Tensor, counts: Sequence[int], group: Group | None = None) -> torch.Tensor:
        """The sum over ``group`` of ``flat`` (its members' pieces one after another, ``counts[i]`` elements for
        member ``i``), of which this rank gets its own piece (a new tensor; uneven counts allowed)."""
        ...

    def all_gather(self, piece: torch.Tensor, counts: Sequence[int], group: Group | None = None) -> torch.Tensor:
        """Every member's ``piece`` (``counts[i]`` elements from member ``i``) one after another, on every member."""
        ...

    # groups and control-plane collectives
    def new_group(self, ranks: Iterable[int]) -> Group: ...

    def barrier(self, group: Group | None = None) -> None: ...

    # object collectives: every rank passes the same kind of object ``T`` (``T | None`` where
    # only the root has one; the receivers narrow what they get)
    def all_gather_object(self, obj: T, group: Group | None = None) -> list[T]: ...

    def bcast_object(self, obj: T, root: int = 0, group: Group | None = None) -> T: ...

    def gather_object(self, obj: T, root: int = 0) -> list[T] | None: ...

    def scatter_object(self, pieces: Sequence[T] | None, root: int = 0) -> T: ...

    def abort(self, code: int = 1) -> None: ...


class DataPlane(Protocol):
    """Tensor transport of a ``Context``: p2p and in-place collectives on contiguous tensors.

    ``Context`` checks arguments (contiguity, default group, groups of one) before it
    delegates, so a plane only moves data.
    """

    @property
    def name(self) -> str: ...

    @property
    def cuda_aware(self) -> bool: ...

    def exchange(self, transfers: Sequence[Transfer], via: Group | Channel | None) -> Request:
        """Post every transfer at once; ``via`` is the route (None: the world)."""
        ...

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> None: ...

    def iall_reduce(self, tensor: torch.Tensor, group: Group) -> Request:
        """Post an in-place sum of ``tensor`` over ``group`` (members post in the same order per group)."""
        ...

    def broadcast(self, tensor: torch.Tensor, root: int, group: Group) -> None: ...

    def reduce_scatter(self, flat: torch.Tensor, out: torch.Tensor, counts: Sequence[int], group: Group) -> None:
        """``out`` = this member's piece of the sum of ``flat`` over ``group`` (``Comm.reduce_scatter``)."""
        ...

    def all_gather(self, piece: torch.Tensor, out: torch.Tensor, counts: Sequence[int], group: Group) -> None:
        """``out`` = every member's ``piece`` one after another (``Comm.all_gather``)."""
        ...

    def process_group(self, ranks: Sequence[int] | None) -> ProcessGroup | None:
        """The plane's own handle of a new group of ``ranks`` (None: the world); collective."""
        ...

    def channel_group(self, src: int, dst: int) -> ProcessGroup | None:
        """The plane's own handle for the one-way channel ``src -> dst`` (None: none needed); collective."""
        ...

    def close(self) -> None: ...
