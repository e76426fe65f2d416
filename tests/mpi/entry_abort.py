"""An error no command turned into a message, raised on rank 0 only, while rank 1 waits in a collective: the entry
(``__main__.main``) prints it and aborts the world, so the job ends instead of rank 1 waiting for ever.

Usage: mpiexec -n 2 python -m tests.mpi.entry_abort
"""

from __future__ import annotations

import sys

from mpi4py import MPI

import mpi4dl_nb.__main__ as entry


def failing_on_rank_0(args: list[str]) -> int:
    if MPI.COMM_WORLD.Get_rank() == 0:
        raise RuntimeError("an error on rank 0 that no command turned into a message")
    MPI.COMM_WORLD.barrier()      # rank 0 never comes
    return 0


if __name__ == "__main__":
    entry.run_command = failing_on_rank_0
    sys.exit(entry.main(["layout"]))
