"""glibc malloc on the ranks: large CPU activations reused instead of unmapped each step, free pages handed back."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable
from dataclasses import dataclass

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1
_TUNED = False
#: training steps between two hand-backs of the heap's free pages (``HeapRelease``)
RELEASE_EVERY_STEPS = 1000


def _libc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has ``mallopt`` and ``malloc_trim``), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None   # not glibc: musl, macOS


def tune_malloc() -> bool:
    """Keep freed memory in the process (no mmap for big blocks, no trimming); True if applied.

    Same effect as launching with ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<large>``.
    Without it glibc returns every freed block over 32 MB to the kernel and the next step
    pays page faults again. RSS then overstates live memory, so measure activations
    directly. Set ``MPI4DL_NO_MALLOC_TUNING=1`` to skip.
    """
    global _TUNED
    if _TUNED:
        return True
    if os.environ.get("MPI4DL_NO_MALLOC_TUNING") == "1":
        return False
    libc = _libc()
    if libc is None:
        return False
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, _INT_MAX) == 1
    _TUNED = ok
    return ok


def release_free_heap() -> bool:
    """Hand every whole free page of malloc's heaps back to the kernel (glibc ``malloc_trim(0)``: the free
    chunks inside the heaps too, not only the top); True if any memory was released. The blocks in use stay."""
    libc = _libc()
    return libc is not None and libc.malloc_trim(0) == 1


@dataclass
class HeapRelease:
    """Every ``every`` training steps (None or 0: never), ``release`` the heap's free pages.

    Why: on a rank that trains for days, glibc's heap fragments. The bytes in use stay flat, but the
    steps' short-lived blocks (tensors, autograd nodes, Python objects) leave free holes that a later
    request of another size does not fit, so the heap's top moves up and its free pages stay resident
    (with or without ``tune_malloc``: glibc trims only the top): in the 10,000-step soak
    (BENCHMARKS.md §9) one or two of 5 ranks grew their RSS by ~200 KiB per 1,000 steps this way.
    Handing the free pages back every ``every`` steps keeps RSS at what the steps use; the next step
    faults back in the pages it reuses, once per ``every`` steps instead of every step (what
    ``tune_malloc`` avoids).
    """

    every: int | None = RELEASE_EVERY_STEPS
    release: Callable[[], bool] = release_free_heap
    steps: int = 0
    releases: int = 0

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 0:
            raise ValueError(f"release_heap_every={self.every}: give a number of steps (0 or None: never)")

    def step_done(self) -> None:
        """Count a finished training step; release the free pages when it is the ``every``-th."""
        self.steps += 1
        if self.every and self.steps % self.every == 0:
            self.release()
            self.releases += 1
