"""Point-to-point latency and bandwidth of both data planes for halo-sized messages (2 ranks).

    mpiexec -n 2 python benchmarks/bench_p2p.py [--repeats 50] [--device cpu|cuda]

Ping-pong between ranks 0 and 1: one-way time = round trip / 2, bandwidth = bytes / one-way
time. Both planes are measured in the same run, interleaved size by size: on CPU the mpi
plane (mpi4py, zero-copy) and gloo; with ``--device cuda`` the mpi plane (CUDA-aware MPI, or
staged through the pinned pool) and nccl, with the stream synchronised after each round trip
so the time covers the transfer, not its launch. Every message is one exchange
(``ctx.exchange``), as the halo and pipeline code post them.
"""

from __future__ import annotations

import argparse
import time

import torch
from support.machine import Footer
from support.tables import Table
from support.world import require_world

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.comm.handles import Transfer

SIZES_KIB = [16, 64, 256, 1024, 4096, 16384]
PLANES = {"cpu": ("mpi", "gloo"), "cuda": ("mpi", "nccl")}


def ping_pong(ctx: Context, nbytes: int, repeats: int) -> float:
    """Median one-way seconds for a message of ``nbytes`` between ranks 0 and 1."""
    buf = torch.ones(nbytes // 8, dtype=torch.float64, device=ctx.device)
    peer = 1 - ctx.rank
    times = []
    for i in range(repeats + 3):
        ctx.barrier()
        start = time.perf_counter()
        legs = [Transfer.to(buf, peer, 7), Transfer.into(buf, peer, 7)]
        for leg in (legs if ctx.rank == 0 else legs[::-1]):
            ctx.exchange([leg]).wait()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
        if i >= 3:
            times.append((time.perf_counter() - start) / 2)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--device", choices=sorted(PLANES), default="cpu")
    args = parser.parse_args()
    footer = Footer()
    torch.set_num_threads(1)
    first, second = PLANES[args.device]
    planes = {name: Context(backend=name, device=args.device) for name in (first, second)}
    ctx0 = planes[first]
    require_world(ctx0, 2)
    rows = []
    for kib in SIZES_KIB:
        row: list[float] = [kib]
        for ctx in planes.values():
            seconds = ping_pong(ctx, kib * 1024, args.repeats)
            row += [seconds * 1e6, kib * 1024 / seconds / 1e9]
        rows.append(row)
    if ctx0.rank == 0:
        staged = " (staged)" if args.device == "cuda" and not ctx0.cuda_aware else ""
        a, b = f"{first}{staged}", second
        table = Table(["message", f">{a} latency (us)", f">{a} GB/s", f">{b} latency (us)", f">{b} GB/s",
                       f">{b}/{first} time"])
        for kib, mt, mb, gt, gb in rows:
            size = f"{int(kib)} KiB" if kib < 1024 else f"{int(kib) // 1024} MiB"
            table.add(size, f"{mt:.1f}", f"{mb:.2f}", f"{gt:.1f}", f"{gb:.2f}", f"{gt / mt:.2f}")
        print(f"device {ctx0.device}, ping-pong, median one-way time of {args.repeats}")
        print(table.markdown())
        footer.print()
    planes[second].close()


if __name__ == "__main__":
    main()
