"""Whether the MPI library reads and writes CUDA memory: an override, MPI 4.1's memory kinds, its query, switches."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from .finalize import loaded_mpi_library

if TYPE_CHECKING:
    from types import ModuleType

OVERRIDE = "MPI4DL_CUDA_AWARE"              # "1": CUDA-aware, "0": not, whatever the library says
MEMORY_KINDS_KEY = "mpi_memory_alloc_kinds"  # MPI 4.1: e.g. "mpi,system,cuda:device" on the world's info
LIBRARY_QUERY = "MPIX_Query_cuda_support"   # Open MPI (mpi-ext.h), MPICH 4: not in mpi4py, called through ctypes
#: launch settings that switch device buffers on where the library has no query: MVAPICH2-GDR's, Open MPI's MCA
SWITCHES: tuple[tuple[str, tuple[str, ...]], ...] = (("MV2_USE_CUDA", ("1",)),
                                                     ("OMPI_MCA_opal_cuda_support", ("1", "true")))


def from_override(env: Mapping[str, str]) -> bool | None:
    value = env.get(OVERRIDE, "")
    return None if value == "" else value == "1"


def from_memory_kinds(kinds: Iterable[str | None]) -> bool | None:
    """True where a kinds list names ``cuda`` (``cuda``, ``cuda:device``...); None: cannot tell."""
    named = {kind.strip().split(":")[0] for text in kinds if text for kind in text.split(",")}
    return True if "cuda" in named else None


def from_library(library: object | None) -> bool | None:
    """The library's own ``MPIX_Query_cuda_support()`` (built with CUDA and switched on); None without one."""
    query = getattr(library, LIBRARY_QUERY, None)
    if query is None:
        return None
    query.restype, query.argtypes = ctypes.c_int, []
    return bool(query())


def from_switches(env: Mapping[str, str]) -> bool | None:
    return True if any(env.get(name, "").lower() in values for name, values in SWITCHES) else None


def memory_kinds(mpi: ModuleType) -> list[str | None]:
    """The memory kinds the world's communicator and the environment's info report (MPI 4.1)."""
    info = mpi.COMM_WORLD.Get_info()
    try:
        return [info.Get(MEMORY_KINDS_KEY), mpi.INFO_ENV.Get(MEMORY_KINDS_KEY)]
    finally:
        info.Free()


def loaded_library() -> ctypes.CDLL | None:
    path = loaded_mpi_library()
    try:
        return ctypes.CDLL(path) if path else None
    except OSError:
        return None


def cuda_aware_mpi(env: Mapping[str, str] | None = None) -> bool:
    """The first answer of: ``MPI4DL_CUDA_AWARE``, MPI 4.1's memory kinds, the library's query, its switches."""
    from mpi4py import MPI

    env = os.environ if env is None else env
    sources: tuple[Callable[[], bool | None], ...] = (
        lambda: from_override(env), lambda: from_memory_kinds(memory_kinds(MPI)),
        lambda: from_library(loaded_library()), lambda: from_switches(env))
    return next((answer for answer in (source() for source in sources) if answer is not None), False)
