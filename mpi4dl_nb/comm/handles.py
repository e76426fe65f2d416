"""Handles the communication layer gives out: a ``Group`` of ranks, a one-way ``Channel``, a
``Transfer`` of an exchange, and a pending ``Request``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI
    from torch.distributed import ProcessGroup


@dataclass
class Group:
    """A set of global ranks with its MPI communicator and (torch plane) process group."""

    ranks: tuple[int, ...]
    mpi_comm: MPI.Comm | None = None       # None on ranks outside the group
    torch_group: ProcessGroup | None = None     # None on the mpi plane
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

    def communicator(self) -> MPI.Comm:
        """The group's MPI communicator; ValueError on a rank outside the group."""
        if self.mpi_comm is None:
            raise ValueError(f"this rank is not in group {self.ranks}: it has no communicator")
        return self.mpi_comm


@dataclass(frozen=True)
class Channel:
    """The one-way link ``src -> dst`` that carries the pipeline payloads between two ranks.

    On the torch plane it has its own two-rank process group, so on NCCL the sends of
    ``src`` and the receives of ``dst`` queue on a stream of their own and match in posting
    order, whatever the other direction does; on the mpi plane ``torch_group`` is None
    (messages go over the world communicator, kept apart by tags).
    """

    src: int
    dst: int
    torch_group: ProcessGroup | None = None


@dataclass(frozen=True)
class Transfer:
    """One message of an exchange: send ``tensor`` to ``peer`` or receive into it from ``peer``.

    ``tag`` separates messages on the mpi plane; the torch plane ignores it (NCCL has no
    tags): there, messages between a pair match in the order they are posted.
    """

    tensor: torch.Tensor
    peer: int
    send: bool
    tag: int = 0

    @classmethod
    def to(cls, tensor: torch.Tensor, peer: int, tag: int = 0) -> Transfer:
        return cls(tensor, peer, True, tag)

    @classmethod
    def into(cls, tensor: torch.Tensor, peer: int, tag: int = 0) -> Transfer:
        return cls(tensor, peer, False, tag)


class Waitable(Protocol):
    """A library's own request object (mpi4py ``Request``, torch.distributed ``Work``)."""

    def wait(self) -> object: ...   # what it returns is not used


@runtime_checkable
class Testable(Protocol):
    """A library request that can say, without blocking, whether it completed (mpi4py's ``Test``)."""

    def test(self) -> bool: ...


class _Completed:
    """A library handle with nothing left to wait for."""

    def wait(self) -> None:
        return None


class Request:
    """A pending non-blocking send or receive; ``wait()`` completes it.

    ``on_done`` runs once the transfer has completed (e.g. copy a staged buffer into the
    tensor); ``keep`` holds buffers that must outlive the transfer.
    """

    def __init__(self, handle: Waitable, on_done: Callable[[], object] | None = None,
                 keep: object = None) -> None:
        self._handle = handle
        self._on_done = on_done
        self._keep = keep
        self.done = False

    @classmethod
    def all_of(cls, handles: Sequence[Waitable], on_done: Callable[[], object] | None = None,
               keep: object = None) -> Request:
        """One request that completes when every handle of ``handles`` has."""
        return cls(_AllOf(tuple(handles)), on_done, keep)

    @classmethod
    def completed(cls) -> Request:
        """A request that is complete on creation (nothing to send: a self-message, a simulated rank)."""
        return cls(_Completed())

    def test(self) -> bool:
        """Whether the transfer completed (then finished as by ``wait``); never blocks. On MPI this also
        drives the library's progress, so a posted collective advances while this rank computes; handles
        that progress on their own (torch.distributed's) answer False until waited."""
        if not self.done and isinstance(self._handle, Testable) and self._handle.test():
            self.wait()
        return self.done

    def wait(self) -> None:
        if self.done:
            return
        self._handle.wait()
        if self._on_done is not None:
            self._on_done()
        self.done = True
        self._keep = None


class _AllOf:
    """Waits for several library requests in turn."""

    def __init__(self, handles: tuple[Waitable, ...]) -> None:
        self.handles = handles

    def test(self) -> bool:
        return all(isinstance(h, Testable) and h.test() for h in self.handles)

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()
