"""Volumes on tiles: a rank's RSS against the tensors it holds over training steps (where the memory goes).

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/bench_volume_rss.py                 # 1x2x1 tiles of 48x96x96
    OMP_NUM_THREADS=1 MPI4DL_NO_MALLOC_TUNING=1 mpiexec -n 2 python benchmarks/bench_volume_rss.py
    OMP_NUM_THREADS=1 python benchmarks/bench_volume_rss.py --grid 1x1x1 --shape 48,48,96   # one process

After each training step of the conv stack (``benchmarks/support/volume_memory.py``, 8 channels) every rank prints
its RSS and peak RSS (above the start), the activation peak (``ActivationMeter``), the bytes of every tensor the
garbage collector reaches and the number of objects it tracks, and the conv backend torch picks for the first and a
later conv on this rank's needed tile. With the library's malloc tuning (``dl.init``; off with
``MPI4DL_NO_MALLOC_TUNING=1``) the RSS settles ~1 GiB above the start on 48x48x96 tiles while the tensors stay
below 30 MiB and flat: glibc's heap holding the freed vol2col buffers of torch's Slow3d kernel (docs/spatial.md,
"RSS beyond the activations"). ``--trim`` calls glibc's ``malloc_trim(0)`` after the last step as a diagnosis only
(it shows how much of the RSS is free heap); it is not something the library does.
"""

from __future__ import annotations

import argparse
import ctypes
import gc

import torch
from support.volume_memory import conv_stack3d, tile_of

import mpi4dl_nb as dl
from mpi4dl_nb.measure.usage import ActivationMeter, live_tensor_bytes
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.geometry import TileGrid

MIB = 2 ** 20


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def conv_backend(channels: int, needed: tuple[int, ...], dtype: torch.dtype) -> str:
    """The kernel torch picks for a 3x3x3 Conv3d of ``channels`` inputs on a ``needed`` tile (unpadded)."""
    x = torch.empty(1, channels, *needed, dtype=dtype)
    weight = torch.empty(8, channels, 3, 3, 3, dtype=dtype)
    found = torch._C._select_conv_backend(x, weight, None, [1, 1, 1], [0, 0, 0], [1, 1, 1], False, [0, 0, 0], 1,
                                          None)
    return str(found).rsplit(".", 1)[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", default="1x2x1", help="DxRxC tiles, one rank each (1x1x1: one process)")
    parser.add_argument("--shape", default="48,96,96", help="the volume's D,H,W")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) after the last step (diagnosis)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = dl.init()
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    shape = tuple(int(n) for n in args.shape.split(","))
    grid = TileGrid.of_shape(tuple(int(n) for n in args.grid.split("x")))
    if grid.num_tiles != ctx.world_size:
        raise SystemExit(f"--grid {args.grid} has {grid.num_tiles} tiles: run with mpiexec -n {grid.num_tiles}")
    torch.manual_seed(0)
    net = torch.nn.Sequential(*conv_stack3d(8, 4)).to(dtype)
    volume = torch.rand(1, 1, *shape, generator=torch.Generator().manual_seed(0), dtype=dtype)
    x = volume if grid.num_tiles == 1 else tile_of(volume, grid, ctx.rank)
    if grid.num_tiles > 1:
        net = spatialize(net, grid, ctx)
    del volume
    needed = tuple(n + 2 for n in x.shape[-3:])
    backends = f"{conv_backend(1, needed, dtype)} / {conv_backend(8, needed, dtype)}"
    live_tensor_bytes()
    gc.collect()
    start_rss, start_peak = status_bytes("VmRSS"), status_bytes("VmHWM")
    print(f"rank {ctx.rank}: tile {tuple(x.shape[-3:])} {args.dtype}, conv backend (1 / 8 input channels) "
          f"{backends}, RSS at start {start_rss / MIB:.0f} MiB", flush=True)
    for step in range(args.steps):
        meter = ActivationMeter(exclude=list(net.parameters()))
        with meter:
            out = net(x)
        out.sum().backward()
        del out
        net.zero_grad(set_to_none=True)
        gc.collect()
        print(f"rank {ctx.rank} step {step + 1}: RSS +{(status_bytes('VmRSS') - start_rss) / MIB:.0f} MiB, "
              f"peak RSS +{(status_bytes('VmHWM') - start_peak) / MIB:.0f} MiB, activation peak "
              f"{meter.peak / MIB:.1f} MiB, live tensors {live_tensor_bytes() / MIB:.1f} MiB, "
              f"gc objects {len(gc.get_objects())}", flush=True)
    if args.trim:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        print(f"rank {ctx.rank} after malloc_trim(0): RSS +{(status_bytes('VmRSS') - start_rss) / MIB:.0f} MiB",
              flush=True)
    ctx.barrier()


if __name__ == "__main__":
    main()
