"""Handles the communication layer gives out: a ``Group`` of ranks and a pending ``Request``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
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


class Waitable(Protocol):
    """A library's own request object (mpi4py ``Request``, torch.distributed ``Work``)."""

    def wait(self) -> Any: ...


class Request:
    """A pending non-blocking send or receive; ``wait()`` completes it.

    ``on_done`` runs once the transfer has completed (e.g. copy a staged buffer into the
    tensor); ``keep`` holds buffers that must outlive the transfer.
    """

    def __init__(self, handle: Waitable, on_done: Callable[[], Any] | None = None,
                 keep: object = None) -> None:
        self._handle = handle
        self._on_done = on_done
        self._keep = keep
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self._handle.wait()
        if self._on_done is not None:
            self._on_done()
        self.done = True
        self._keep = None
