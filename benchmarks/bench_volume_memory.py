"""Volumes on tiles: activation bytes per rank of a 3-D conv stack and the 3-D U-Net, P = 2, 4, 8 vs one process.

    OMP_NUM_THREADS=1 mpiexec -n 8 python benchmarks/bench_volume_memory.py        # 64^3 and 48^3: under a minute
    OMP_NUM_THREADS=1 mpiexec -n 8 python benchmarks/bench_volume_memory.py --stack-side 128 --unet-side 96

What is measured: the bytes autograd keeps during one training step's forward and backward (loss: the output's
sum), each storage once (``ActivationMeter``: the count the training loop and bench_unet.py use; not RSS, the
allocator keeps freed pages), its peak, on one process (rank 0, the whole volume) and on each of the P tile
ranks (``spatialize``, each rank holding its tile): P = 2 on a 2x1x1 grid (ranks 0-1), 4 on 2x2x1 (ranks 0-3),
8 on 2x2x2 (all eight). The other ranks wait, so the machine holds one volume's activations at a time.

Printed per network and P: the largest rank's peak, its ratio to one process and issue 45's acceptance bound
1.15/P side by side (the bound is the conv stack's; the U-Net's lines show where it stands). The halo a tile
keeps for backward is the one-voxel shell its neighbours send (``SpatialConv3d`` keeps the owned tile and the
received strips, not the needed tile), so the ratio tends to 1/P as the tiles grow.

Sizes: the defaults (a 64^3 volume through the conv stack, 8 channels; 48^3 through the 3-D U-Net, depth 2,
width 8; float32) keep the job near 2 GiB beyond its eight processes' own ~2.1 GiB on this project's 2-core,
24 GiB machine, shared with other jobs (the machine's available memory fell by ~4.4 GiB during a run, by ~2.1 GiB
with 16^3 volumes). The activations themselves are small (one process keeps 33 MiB for the stack at 64^3,
264 MiB at 128^3); what the processes hold beyond them grows faster (with 96^3 and 64^3 the available memory
fell by 8-10 GiB; with 128^3 and 96^3 the ranks' peak RSS summed to ~10.6 GiB, 1.0-1.9 GiB each, the ranks of
the 2x2x1 grid growing most), so the larger sizes of the second command need a machine to themselves. The growth
is in the tile path and depends on the tile's shape: a 48x48x96 tile through the stack raises a rank's peak RSS by
0.8-1.2 GiB (a 96x48x48 tile: 0.13 GiB). Located (benchmarks/bench_volume_rss.py, docs/spatial.md "RSS beyond the
activations"): no tensor of ours piles up (live tensor bytes and gc objects flat over steps); torch's Slow3d conv
kernel (float64 always, float32 when N x C x D x H <= 20480, as on a 2x2x1 tile of 96^3) unfolds each input into a
27x larger buffer, and under the library's malloc tuning (``dl.init``: no mmap, no trimming) glibc's heap keeps the
freed buffers, fragmented by the small tensors allocated between them. ``MPI4DL_NO_MALLOC_TUNING=1`` (and no
``MALLOC_MMAP_MAX_=0`` in the environment) brings a rank's peak RSS from ~1.1 GiB to ~0.3 GiB above its start.
"""

from __future__ import annotations

import argparse

import torch
from support.machine import Footer
from support.volume_memory import GRIDS, conv_stack3d, measure
from support.world import require_world

import mpi4dl_nb as dl
from mpi4dl_nb.models.unet3d import unet3d

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack-side", type=int, default=64, help="the conv stack's volume side (even)")
    parser.add_argument("--unet-side", type=int, default=48, help="the U-Net's volume side (a multiple of 8)")
    parser.add_argument("--channels", type=int, default=8, help="the conv stack's and the U-Net's first width")
    parser.add_argument("--convs", type=int, default=4, help="Conv3d + ReLU pairs in the conv stack")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    args = parser.parse_args()
    footer = Footer()
    torch.set_num_threads(1)
    ctx = dl.init()
    require_world(ctx, 8, "bench_volume_memory")
    dtype = DTYPES[args.dtype]

    def stack() -> list[torch.nn.Module]:
        torch.manual_seed(0)
        return conv_stack3d(args.channels, args.convs)

    def unet() -> list[torch.nn.Module]:
        torch.manual_seed(0)
        return unet3d(2, args.channels, 2)

    runs = ((f"conv stack ({args.convs} x Conv3d 3^3 + ReLU, {args.channels} channels) {args.stack_side}^3",
             stack, args.stack_side),
            (f"3-D U-Net (depth 2, width {args.channels}, BatchNorm, trilinear) {args.unet_side}^3",
             unet, args.unet_side))
    for what, layers, side in runs:
        volume = torch.rand(1, 1, side, side, side, generator=torch.Generator().manual_seed(0), dtype=dtype)
        found = measure(ctx, layers, volume, tuple(GRIDS))
        if found is not None:
            print("\n".join(found.lines(what)), flush=True)
        del volume
    if ctx.rank == 0:
        print(f"{args.dtype}, batch 1, one forward + backward; activation bytes autograd keeps (each storage once), "
              f"largest tile rank over one process")
        footer.print()


if __name__ == "__main__":
    main()
