"""Harness self-test: rank 1 raises ('fail'), every rank blocks forever ('hang'), named checks with a
failure on rank 1 ('checks'), or a failure after which rank 1 leaves the ranks out of step ('stall')."""

import sys
import time

from mpi4py import MPI

from tests.support.checks import Checks, run_checks

PASSES, FAILS, STALLS = "passes everywhere", "fails on rank 1", "fails on rank 1, then out of step"


def named_checks(check: Checks) -> None:
    with check(PASSES) as result:
        result.detail = "fine"
    with check(FAILS):
        assert check.rank != 1, "rank 1 disagrees"


def stalled(check: Checks) -> None:
    with check(STALLS):
        assert check.rank != 1, "rank 1 disagrees"
        MPI.COMM_WORLD.Barrier()    # rank 1 skips it: the other ranks wait for ever
    if check.rank == 1:
        MPI.COMM_WORLD.recv(source=0, tag=98)   # never sent


mode = sys.argv[1]
comm = MPI.COMM_WORLD
if mode == "checks":
    run_checks(named_checks)
if mode == "stall":
    run_checks(stalled, grace=2.0)
if mode == "fail" and comm.rank == 1:
    raise RuntimeError("deliberate failure on rank 1")
if mode == "hang":
    if comm.rank == 0:
        comm.recv(source=1, tag=99)   # never sent
    else:
        time.sleep(3600)
comm.Barrier()
