"""Reusable host buffers (pinned when CUDA is present) for staging device tensors through host memory."""

from __future__ import annotations

import torch

MIN_BUFFER = 4096   # bytes: the smallest size class
DEFAULT_CAP_BYTES = 1 << 30   # bytes a pool keeps (pinned host memory is scarce): what is in flight, not all it sent


def size_class(nbytes: int) -> int:
    """The buffer size serving a request of ``nbytes``: the next power of two, at least MIN_BUFFER."""
    return max(MIN_BUFFER, 1 << max(0, int(nbytes) - 1).bit_length())


class PinnedPool:
    """Host staging buffers reused across messages instead of one new pinned buffer per message.

    ``take(like)`` lends a host tensor shaped like ``like`` (a view of a byte buffer of its
    size class); ``give(view)`` returns it. A returned buffer serves any later request of
    its size class. The free buffers are kept while the pool holds at most ``cap_bytes``
    (lent and free together), the least recently returned freed first beyond it: a lent buffer is never
    taken back, so a message larger than the cap still travels. ``pin`` (default: whether CUDA is available)
    page-locks the buffers, which device-to-host copies need to run asynchronously and fast.
    """

    def __init__(self, pin: bool | None = None, cap_bytes: int = DEFAULT_CAP_BYTES) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.cap_bytes = cap_bytes
        self._free: list[torch.Tensor] = []     # least recently returned first
        self._lent: dict[int, torch.Tensor] = {}
        self.created = 0       # buffers ever allocated (constant once the pool is warm)
        self.freed = 0         # buffers dropped to keep within ``cap_bytes``

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A host tensor of ``like``'s shape and dtype (contents undefined); ``give`` it back."""
        nbytes = like.numel() * like.element_size()
        size = size_class(nbytes)
        index = next((i for i in reversed(range(len(self._free))) if self._free[i].numel() == size), None)
        if index is not None:
            buffer = self._free.pop(index)
        else:
            buffer = torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
            self.created += 1
        view = buffer[:nbytes].view(like.dtype).view(like.shape)
        self._lent[id(view)] = buffer
        return view

    def give(self, view: torch.Tensor) -> None:
        """Return a tensor lent by ``take`` (once its transfer and copies are complete)."""
        buffer = self._lent.pop(id(view), None)
        if buffer is None:
            raise ValueError("give() of a tensor this pool did not lend (or gave back already)")
        self._free.append(buffer)
        while self._free and self.held_bytes > self.cap_bytes:
            self._free.pop(0)
            self.freed += 1

    @property
    def lent(self) -> int:
        return len(self._lent)

    @property
    def held_bytes(self) -> int:
        """Bytes of every buffer the pool owns, lent or free."""
        return sum(b.numel() for b in self._free) + sum(b.numel() for b in self._lent.values())

    def clear(self) -> None:
        """Drop the free buffers (lent ones stay lent)."""
        self._free.clear()
