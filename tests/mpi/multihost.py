"""MPI across test hosts (engines/hosts): each rank's node-local view, the checkpoint directory check, and SP+LP
exact on both data planes with the tiles on two hosts and the layer stage on a third.

Usage (under engines/hosts/mpiexec): python -m tests.mpi.multihost --hosts=h1,h1,h2,h2,h3 --shared=DIR
--scratch=DIR [CASE]. ``--hosts``: the host of each slot, as launched (the ranks fill them in order). Named
checks: ``placement`` (hostname, local rank and node size of every rank, the CUDA device each would take, the
malloc settings),
``summary host`` (the run summary's per-rank host), ``checkpoint dir shared``, ``checkpoint dir node-local
refused``, then CASE (tests/support/engine_cases.py, default sp_lp_square) on the mpi plane and, prefixed
``gloo: ``, on the torch plane (tests/mpi/engine_exact.py's comparison with one process, float64).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch

import mpi4dl_nb as dl
from mpi4dl_nb.comm.allocator import tune_malloc
from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.comm.device import select_device
from mpi4dl_nb.comm.launcher import placement
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.run.checkpoint_space import require_shared
from mpi4dl_nb.run.summary import RankMetrics
from tests.mpi.engine_exact import run_case
from tests.support.checks import Checks, run_checks
from tests.support.engine_cases import CASES

FAKE_GPUS = 2     # GPUs per node the device choice is asked about (no GPU is touched)


def check_placement(ctx: Context, slots: list[str]) -> str:
    """Every rank on its slot's host, local rank and node size counted per host, device index per node."""
    expected = placement(ctx.world_size, slots)
    seen = ctx.all_gather_object((socket.gethostname(), ctx.local_rank, ctx.local_size))
    for rank, (host, local_rank, local_size) in enumerate(seen):
        mates = [r for r, h in enumerate(expected) if h == expected[rank]]
        want = (expected[rank], mates.index(rank), len(mates))
        assert (host, local_rank, local_size) == want, \
            f"rank {rank}: (host, local rank, node size) {(host, local_rank, local_size)}, expected {want}"
    device = select_device(ctx.local_rank, cuda_count=FAKE_GPUS)
    assert device == torch.device("cuda", ctx.local_rank % FAKE_GPUS), f"rank {ctx.rank}: {device}"
    assert os.environ.get("MALLOC_MMAP_MAX_") == "0" and tune_malloc(), f"rank {ctx.rank}: malloc not tuned"
    return f"{', '.join(f'{r}:{h}/{lr}of{ls}' for r, (h, lr, ls) in enumerate(seen))}; wait {ctx.wait_mode}"


def check_summary_host(ctx: Context) -> None:
    mine = RankMetrics(ctx.rank, 0, 0.0, 0.0, 0.0, 0, 0, 0, "counted")
    hosts = ctx.all_gather_object(mine.host)
    assert mine.host == socket.gethostname() and len(set(hosts)) > 1, hosts


def check_node_local_refused(ctx: Context, scratch: Path, slots: list[str]) -> str:
    folder = scratch / "ck"
    folder.mkdir(parents=True, exist_ok=True)           # each host's own disk
    try:
        require_shared(ctx, folder)
    except ConfigError as err:
        text = str(err)
    else:
        raise AssertionError(f"{folder} (node-local) was taken as shared")
    others = sorted(set(slots) - {slots[0]})
    assert "is not shared between the job's hosts" in text and all(h in text for h in others), text
    texts = ctx.all_gather_object(text)
    assert len(set(texts)) == 1, f"ranks disagree: {texts}"
    return text


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    options = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or ["sp_lp_square"]
    slots = options["hosts"].split(",")
    ctx = dl.init(backend="mpi")
    with check("placement") as result:
        result.detail = check_placement(ctx, slots)
    with check("summary host"):
        check_summary_host(ctx)
    with check("checkpoint dir shared"):
        require_shared(ctx, Path(options["shared"]))
    with check("checkpoint dir node-local refused") as result:
        result.detail = check_node_local_refused(ctx, Path(options["scratch"]), slots)[:160]
    for name in names:
        with check(name) as result:
            result.detail = run_case(ctx, name, check, CASES)
    gloo = Context(backend="gloo")
    check.prefix = "gloo: "
    for name in names:
        with check(name) as result:
            result.detail = run_case(gloo, name, check, CASES)
    check.prefix = ""
    gloo.close()


if __name__ == "__main__":
    run_checks(main)
