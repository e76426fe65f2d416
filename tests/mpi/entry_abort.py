"""An error no command turned into a message, raised on rank 0 only, while rank 1 waits in a collective: the entry
(``__main__.main``) prints it and aborts the world, so the job ends instead of rank 1 waiting for ever.

With ``config``: the error is a ConfigError (as ``Context`` raises for ``--backend nccl`` on shared GPUs): one line
naming it, no traceback, exit status 2 (cli/layout_cmd.EXIT_CONFIG).

Usage: mpiexec -n 2 python -m tests.mpi.entry_abort [config]
"""

from __future__ import annotations

import sys

from mpi4py import MPI

import mpi4dl_nb.__main__ as entry
from mpi4dl_nb.errors import ConfigError

CONFIG = sys.argv[1:] == ["config"]


def failing_on_rank_0(args: list[str]) -> int:
    if MPI.COMM_WORLD.Get_rank() == 0:
        if CONFIG:
            raise ConfigError("--backend", "nccl needs a GPU per rank; use --backend mpi")
        raise RuntimeError("an error on rank 0 that no command turned into a message")
    MPI.COMM_WORLD.barrier()      # rank 0 never comes
    return 0


if __name__ == "__main__":
    entry.run_command = failing_on_rank_0
    sys.exit(entry.main(["layout"]))
