"""glibc malloc tuning so large CPU activations are reused instead of unmapped each step."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1
_TUNED = False


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
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False   # not glibc (musl, macOS): nothing to tune
    ok = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, _INT_MAX) == 1
    _TUNED = ok
    return ok
