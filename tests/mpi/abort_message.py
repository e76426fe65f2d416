"""MPI (3 ranks): rank 0 writes its last words and aborts the job; the words must reach mpiexec's output."""

from __future__ import annotations

import sys
import time

import mpi4dl_nb as dl

LAST_WORDS = "last words of rank 0 before the abort"


def main() -> None:
    ctx = dl.init()
    if ctx.rank == 0:
        sys.stderr.write(LAST_WORDS + "\n")
        ctx.abort(5)
    time.sleep(60)
    print("unreachable: the job was not aborted", flush=True)


if __name__ == "__main__":
    main()
