"""Spatial parallelism: speed-up of a conv stack on 2 ranks vs 1, and activation memory per rank.

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 OMP_NUM_THREADS=1 \\
        mpiexec -n 2 python benchmarks/bench_spatial.py speed --size 2048 --steps 3
    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 OMP_NUM_THREADS=1 \\
        mpiexec -n 4 python benchmarks/bench_spatial.py memory --size 2048

speed: a 3-layer 16-channel 3x3 conv stack (+ReLU), forward+backward, batch 1, float32, one
thread per rank. Rounds alternate, side by side in one run: (A) rank 0 alone runs the
serial model while rank 1 waits; (B) both ranks run the spatialized model on half the image
each (vertical cuts); (C) both ranks run the serial model independently (the machine's
2-process ceiling). Prints the best time of each and speed-up = A/B, efficiency = speed-up/2.

memory: bytes of activations saved for backward (saved_tensors_hooks, unique storages) plus
the output, per rank, for the serial model and for 1, 2 and 4 tiles (square grid for 4).
Ideal ratio to serial: 1/P. RSS is not used (the tuned allocator keeps freed memory).
"""

from __future__ import annotations

import argparse

import torch
from support.machine import Footer
from support.memory import activation_bytes
from support.models import conv_stack
from support.tables import Table
from support.timing import best_of
from support.world import require_world

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.spatial.convert import reduce_tile_gradients, spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tiles import scatter_tiles


def speed(ctx: Context, size: int, steps: int, rounds: int, slice_method: str) -> None:
    require_world(ctx, 2, "speed")
    torch.manual_seed(0)
    model = conv_stack()
    image = torch.randn(1, 3, size, size)
    grid = TileGrid.from_slice_method(slice_method, 2)
    net = spatialize(model, grid, ctx, image_size=(size, size))
    tile = scatter_tiles(image, grid, ctx)

    def serial() -> None:
        model.zero_grad(set_to_none=True)
        model(image).sum().backward()

    def spatial() -> None:
        net.zero_grad(set_to_none=True)
        net(tile).sum().backward()
        reduce_tile_gradients(net)

    best = {"A": float("inf"), "B": float("inf"), "C": float("inf")}
    serial()   # warm-up both paths (allocator, geometry caches)
    spatial()
    for _ in range(rounds):
        ctx.barrier()
        if ctx.rank == 0:
            best["A"] = min(best["A"], best_of(serial, steps))
        ctx.barrier()
        best["B"] = min(best["B"], best_of(spatial, steps))
        ctx.barrier()
        best["C"] = min(best["C"], best_of(serial, steps))
    times = torch.tensor([best["A"], best["B"], best["C"]], dtype=torch.float64)
    slowest = ctx.all_gather_object(times.tolist())
    if ctx.rank == 0:
        a = slowest[0][0]
        b = max(r[1] for r in slowest)
        c = max(r[2] for r in slowest)
        print(f"conv stack 3x16ch 3x3, {size}x{size}, fwd+bwd, 1 thread/rank, best of "
              f"{rounds}x{steps} steps")
        table = Table(["run", ">seconds/step", ">speed-up vs 1 rank", ">efficiency (ideal 2.0)"])
        table.add("A: serial, 1 rank", f"{a:.3f}", "1.00", "-")
        table.add(f"B: spatial, 2 ranks ({grid.rows}x{grid.cols} tiles)", f"{b:.3f}", f"{a / b:.2f}",
                  f"{a / b / 2:.2f}")
        table.add("C: 2 independent serial ranks (ceiling)", f"{c:.3f}", f"{2 * a / c:.2f} (throughput)",
                  f"{a / c:.2f}")
        print(table.markdown())
        print(f"efficiency of spatial vs this machine's 2-process ceiling: "
              f"{(a / b) / (2 * a / c):.2f}")


def memory(ctx: Context, size: int) -> None:
    require_world(ctx, 4, "memory", at_least=True)
    torch.manual_seed(0)
    model = conv_stack()
    image = torch.randn(1, 3, size, size)
    results = {}
    if ctx.rank == 0:
        results["serial"] = activation_bytes(model, image)
    for key, parts, grid, fused in ((1, 1, TileGrid(1, 1), False), (2, 2, TileGrid(1, 2), False),
                                    (4, 4, TileGrid(2, 2), False), ("4f", 4, TileGrid(2, 2), True)):
        group = ctx.new_group(range(parts))
        if ctx.rank < parts:
            net = spatialize(model, grid, ctx, group, image_size=(size, size), halo_d2=fused,
                             fused_layers=3)
            tile = scatter_tiles(image, grid, ctx, group)
            results[key] = activation_bytes(net, tile)
        ctx.barrier()
    gathered = ctx.all_gather_object(results)
    if ctx.rank == 0:
        serial = gathered[0]["serial"]
        print(f"activation bytes per rank, conv stack 3x16ch, {size}x{size}, batch 1, float32")
        table = Table([">tiles P", ">max bytes/rank (MiB)", ">ratio to serial", ">ideal 1/P", ">goal <= 1.15/P"])
        table.add("serial", f"{serial / 2**20:.1f}", "1.000", "1.000", "-")
        for key, parts, label in ((1, 1, "1"), (2, 2, "2"), (4, 4, "4"),
                                  ("4f", 4, "4, fused halos (3 layers)")):
            worst = max(r[key] for r in gathered[:parts])
            ratio = worst / serial
            table.add(label, f"{worst / 2**20:.1f}", f"{ratio:.3f}", f"{1 / parts:.3f}",
                      "yes" if ratio <= 1.15 / parts else "NO")
        print(table.markdown())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["speed", "memory"])
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", default="mpi")
    parser.add_argument("--slice-method", default="vertical", choices=["vertical", "horizontal"],
                        help="speed: how the 2 tiles cut the image")
    args = parser.parse_args()
    footer = Footer()
    torch.set_num_threads(1)
    ctx = Context(backend=args.backend, trace=False)
    if args.what == "speed":
        speed(ctx, args.size, args.steps, args.rounds, args.slice_method)
    else:
        memory(ctx, args.size)
    if ctx.rank == 0:
        footer.print()


if __name__ == "__main__":
    main()
