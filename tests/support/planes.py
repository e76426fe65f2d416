"""The data plane an MPI test program runs on: ``--backend=NAME`` among its arguments (default mpi).

Every multi-rank exactness family runs on the mpi plane and, for a representative subset of
its cases, on the torch plane (``--backend=gloo``): the code path NCCL takes on GPUs (one
``batch_isend_irecv`` group per exchange, messages matched by posting order, no tags).
"""

from __future__ import annotations

from collections.abc import Sequence

FLAG = "--backend="


def split_backend(argv: Sequence[str], default: str = "mpi") -> tuple[str, list[str]]:
    """(backend, the other arguments) from a program's arguments; the last ``--backend=`` wins."""
    backends = [a[len(FLAG):] for a in argv if a.startswith(FLAG)]
    return (backends[-1] if backends else default), [a for a in argv if not a.startswith(FLAG)]


def backend_flag(backend: str) -> str:
    return f"{FLAG}{backend}"
