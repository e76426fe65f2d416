"""A temporary folder shared by every rank of an MPI test program: made by rank 0, removed after the last rank."""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mpi4dl_nb.comm.context import Context


@contextmanager
def shared_temp_folder(ctx: Context, prefix: str) -> Iterator[Path]:
    """Rank 0 makes the folder and every rank gets its path; on exit all ranks meet, then rank 0 removes it."""
    folder = ctx.bcast_object(tempfile.mkdtemp(prefix=prefix) if ctx.rank == 0 else None, root=0)
    try:
        yield Path(folder)
    finally:
        ctx.barrier()
        if ctx.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
