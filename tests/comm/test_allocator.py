"""glibc malloc on the ranks (comm/allocator.py): the tuning keeps freed blocks, the release hands their pages back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mpi4dl_nb.comm.allocator import HeapRelease

# In a fresh process (its heap not shared with pytest's), under the ranks' tuning (no mmap, no trimming): 64 MiB of
# 64 KiB blocks, each followed by a small block that stays, are written and freed. They are free holes inside the
# heap, so freeing them keeps them resident; the release must return them.
FRAGMENTED_HEAP = """
import ctypes
from mpi4dl_nb.comm.allocator import release_free_heap, tune_malloc
from mpi4dl_nb.measure.usage import anon_rss_bytes
assert tune_malloc()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks, kept = [], []
for _ in range(1024):
    block = libc.malloc(65536)
    ctypes.memset(block, 1, 65536)
    blocks.append(block)
    kept.append(libc.malloc(64))
for block in blocks:
    libc.free(block)
freed = anon_rss_bytes()
released = release_free_heap()
print(released, freed - anon_rss_bytes())
"""


def glibc() -> bool:
    return os.confstr("CS_GNU_LIBC_VERSION") is not None if hasattr(os, "confstr") else False


def test_the_release_hands_freed_holes_inside_the_heap_back_to_the_kernel():
    if not glibc():
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs on glibc: the heap release must be tested there")
        pytest.skip("not glibc: nothing to release (the engine's release is a no-op); run on Linux with glibc")
    done = subprocess.run([sys.executable, "-c", FRAGMENTED_HEAP], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MPI4DL_NO_MALLOC_TUNING": "0"})
    assert done.returncode == 0, done.stderr
    released, dropped = done.stdout.split()
    assert released == "True" and int(dropped) > 48 * 2**20, done.stdout   # of the 64 MiB freed


def test_a_release_every_n_steps_and_none_never():
    calls: list[int] = []
    heap = HeapRelease(every=3, release=lambda: calls.append(1) is None)
    for _ in range(10):
        heap.step_done()
    assert (len(calls), heap.releases, heap.steps) == (3, 3, 10)
    never = HeapRelease(every=None, release=lambda: pytest.fail("released"))
    for _ in range(5):
        never.step_done()
    assert never.releases == 0
    with pytest.raises(ValueError, match="release_heap_every=-1"):
        HeapRelease(every=-1)
