"""Point-to-point latency and bandwidth of both data planes for halo-sized messages (2 ranks).

    mpiexec -n 2 python benchmarks/bench_p2p.py [--repeats 50]

Ping-pong between ranks 0 and 1: one-way time = round trip / 2, bandwidth = bytes / one-way
time. Both planes are measured in the same run, interleaved size by size.
"""

from __future__ import annotations

import argparse
import time

import torch

from mpi4dl_nb.comm.context import Context

SIZES_KIB = [16, 64, 256, 1024, 4096, 16384]


def ping_pong(ctx: Context, nbytes: int, repeats: int) -> float:
    """Median one-way seconds for a message of ``nbytes`` between ranks 0 and 1."""
    buf = torch.ones(nbytes // 8, dtype=torch.float64)
    peer = 1 - ctx.rank
    times = []
    for i in range(repeats + 3):
        ctx.barrier()
        start = time.perf_counter()
        if ctx.rank == 0:
            ctx.send(buf, peer, tag=7)
            ctx.recv(buf, peer, tag=7)
        else:
            ctx.recv(buf, peer, tag=7)
            ctx.send(buf, peer, tag=7)
        if i >= 3:
            times.append((time.perf_counter() - start) / 2)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    planes = {"mpi4py": Context(backend="mpi"), "gloo": Context(backend="gloo")}
    if planes["mpi4py"].world_size != 2:
        raise SystemExit("run with mpiexec -n 2")
    rows = []
    for kib in SIZES_KIB:
        row = [kib]
        for ctx in planes.values():
            seconds = ping_pong(ctx, kib * 1024, args.repeats)
            row += [seconds * 1e6, kib * 1024 / seconds / 1e9]
        rows.append(row)
    if planes["mpi4py"].rank == 0:
        print("| message | mpi4py latency (us) | mpi4py GB/s | gloo latency (us) | gloo GB/s | gloo/mpi4py time |")
        print("|---:|---:|---:|---:|---:|---:|")
        for kib, mt, mb, gt, gb in rows:
            size = f"{kib} KiB" if kib < 1024 else f"{kib // 1024} MiB"
            print(f"| {size} | {mt:.1f} | {mb:.2f} | {gt:.1f} | {gb:.2f} | {gt / mt:.2f} |")
    planes["gloo"].close()


if __name__ == "__main__":
    main()
