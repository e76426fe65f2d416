"""Harness self-test: rank 1 raises ('fail') or every rank blocks forever ('hang')."""

import sys
import time

from mpi4py import MPI

mode = sys.argv[1]
comm = MPI.COMM_WORLD
if mode == "fail" and comm.rank == 1:
    raise RuntimeError("deliberate failure on rank 1")
if mode == "hang":
    if comm.rank == 0:
        comm.recv(source=1, tag=99)   # never sent
    else:
        time.sleep(3600)
comm.Barrier()
