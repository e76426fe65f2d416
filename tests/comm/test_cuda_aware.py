"""CUDA-aware MPI told from each source, faked: the override, MPI 4.1's memory kinds, the library's own query
(``MPIX_Query_cuda_support``, not in mpi4py), the launch switches; the first that answers wins."""

from __future__ import annotations

import pytest

from mpi4dl_nb.comm import cuda_aware
from mpi4dl_nb.comm.cuda_aware import (
    cuda_aware_mpi,
    from_library,
    from_memory_kinds,
    from_override,
    from_switches,
    memory_kinds,
)
from mpi4dl_nb.comm.mpi_plane import cuda_aware_mpi as planes_query


class _Library:
    """A loaded MPI library with Open MPI's ``MPIX_Query_cuda_support`` answering ``answer``."""

    def __init__(self, answer: int) -> None:
        def query() -> int:
            return answer
        self.MPIX_Query_cuda_support = query


def test_the_override_says_yes_or_no() -> None:
    assert from_override({"MPI4DL_CUDA_AWARE": "1"}) is True
    assert from_override({"MPI4DL_CUDA_AWARE": "0"}) is False
    assert from_override({}) is None


def test_mpi_41_memory_kinds_name_cuda() -> None:
    assert from_memory_kinds(["mpi,system,cuda:device", None]) is True
    assert from_memory_kinds([None, "mpi, cuda"]) is True
    assert from_memory_kinds(["mpi,system", None]) is None       # kinds asked for, cuda not among them: ask on
    assert from_memory_kinds([None, None]) is None


def test_the_librarys_own_query() -> None:
    assert from_library(_Library(1)) is True
    assert from_library(_Library(0)) is False
    assert from_library(object()) is None and from_library(None) is None


def test_launch_switches_of_mvapich_and_open_mpi() -> None:
    assert from_switches({"MV2_USE_CUDA": "1"}) is True
    assert from_switches({"OMPI_MCA_opal_cuda_support": "true"}) is True
    assert from_switches({"MV2_USE_CUDA": "0"}) is None and from_switches({}) is None


def test_this_machines_mpi_reports_its_kinds_and_is_not_cuda_aware() -> None:
    from mpi4py import MPI

    kinds = memory_kinds(MPI)
    assert len(kinds) == 2 and all(k is None or isinstance(k, str) for k in kinds)
    assert cuda_aware_mpi({}) is False


@pytest.mark.parametrize(("kinds", "library", "env", "aware"), [
    (["mpi,system,cuda"], None, {}, True),                       # MPI 4.1 alone
    ([None], _Library(1), {}, True),                             # Open MPI / MPICH's query alone
    ([None], _Library(0), {"MV2_USE_CUDA": "1"}, False),         # the library's answer before a switch
    ([None], None, {"MV2_USE_CUDA": "1"}, True),                 # MVAPICH2-GDR's switch
    (["mpi,system,cuda"], _Library(1), {"MPI4DL_CUDA_AWARE": "0"}, False),   # the override first
    ([None], None, {}, False),
])
def test_the_first_source_that_answers_wins(monkeypatch: pytest.MonkeyPatch, kinds: list[str | None],
                                             library: _Library | None, env: dict[str, str], aware: bool) -> None:
    monkeypatch.setattr(cuda_aware, "memory_kinds", lambda mpi: kinds)
    monkeypatch.setattr(cuda_aware, "loaded_library", lambda: library)
    for name in ("MPI4DL_CUDA_AWARE", "MV2_USE_CUDA", "OMPI_MCA_opal_cuda_support"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert planes_query() is aware
