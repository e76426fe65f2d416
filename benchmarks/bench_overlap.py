"""Halo overlap and region convs/pools: spatial stacks' forward with and without the extended-tile copy and the overlap.

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 OMP_NUM_THREADS=1 \\
        mpiexec -n 2 python benchmarks/bench_overlap.py --size 2048 --backend mpi
    (and --backend gloo: the torch plane, whose messages progress on gloo's own threads)

Two stacks on 2 ranks (2 tiles on top of each other: every layer exchanges rows), side by
side in one run, rounds alternating the configurations:

* ``conv3x3``: 3 layers of 16-channel 3x3 convs (the copy-free banded path), with
  ``spatial.conv.HALO_OVERLAP`` on and off;
* ``stem``: a ResNet stem (conv 7x7/2 + ReLU + max pool 3x3/2 + conv 3x3/2, 16 channels):
  the old extended path (``spatial.conv.REGIONS = False``: the tile copied into an extended
  buffer per exchange) against the region path (interior from the owned tile, bands from
  small boxes), overlap off and on.

Printed per configuration: best forward and forward+backward seconds (slowest rank) and the
halo exchanges' own time per forward (trace, rank 0; it includes waiting for the
neighbour) and the bytes autograd keeps for backward (rank 0); for the stem, per windowed layer, the
time of the extended-tile build (``HaloExchange.extend``) against receiving the strips only
(``exchange_strips``): the per-exchange copy the region path saves. Outputs are checked
equal across configurations.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
from support.machine import Footer
from support.memory import SavedBytes
from support.models import conv_stack
from support.tables import Table

import mpi4dl_nb as dl
from mpi4dl_nb.spatial import conv as spatial_conv
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.kernel_layer import SpatialKernelLayer
from mpi4dl_nb.spatial.tiles import scatter_tiles

Config = tuple[str, bool, bool]   # (label, regions, overlap)


def stem_stack() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 7, stride=2, padding=3), torch.nn.ReLU(),
                               torch.nn.MaxPool2d(3, stride=2, padding=1),
                               torch.nn.Conv2d(16, 16, 3, stride=2, padding=1))


def time_configs(ctx, net: torch.nn.Module, tile: torch.Tensor, configs: Sequence[Config],
                 rounds: int) -> list[dict[str, list[float]]]:
    """Per rank, per config label: [best forward s, best forward+backward s, halo s in a forward,
    bytes saved for backward]."""
    best = {label: [float("inf"), float("inf"), 0.0, 0.0] for label, _, _ in configs}
    outputs = {}
    try:
        for _ in range(rounds):
            for label, regions, overlap in configs:
                spatial_conv.REGIONS, spatial_conv.HALO_OVERLAP = regions, overlap
                ctx.barrier()
                halo = ctx.tracer.totals().get("halo")
                halo_before = halo.seconds if halo else 0.0
                saved = SavedBytes()
                start = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                    out = net(tile)
                forward = time.perf_counter() - start
                halo = ctx.tracer.totals().get("halo")
                halo_seconds = (halo.seconds if halo else 0.0) - halo_before
                out.sum().backward()
                step = time.perf_counter() - start
                net.zero_grad(set_to_none=True)
                outputs[label] = out.detach()
                entry = best[label]
                entry[0], entry[1] = min(entry[0], forward), min(entry[1], step)
                entry[2], entry[3] = halo_seconds, saved.total
                del out
    finally:
        spatial_conv.REGIONS, spatial_conv.HALO_OVERLAP = True, False
    first = outputs[configs[0][0]]
    assert all(torch.allclose(o, first, rtol=1e-5, atol=1e-5) for o in outputs.values())
    return ctx.all_gather_object(best)


def time_copies(ctx, net: torch.nn.Module, tile: torch.Tensor, rounds: int) -> list[tuple[str, float, float]]:
    """Per windowed layer (rank 0): best seconds of ``extend`` (strips + extended tile) and of
    ``exchange_strips`` (strips only) on that layer's input."""
    inputs: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: inputs.__setitem__(n, a[0].detach()))
             for n, m in net.named_modules() if isinstance(m, SpatialKernelLayer)]
    with torch.no_grad():
        net(tile)
    for h in hooks:
        h.remove()
    found = []
    for name, layer in net.named_modules():
        if name not in inputs:
            continue
        (exchange,) = layer._exchanges.values()
        times = {}
        for label, call in (("extend", exchange.extend), ("strips", exchange.exchange_strips)):
            best = float("inf")
            for _ in range(rounds):
                ctx.barrier()
                start = time.perf_counter()
                call(inputs[name])
                best = min(best, time.perf_counter() - start)
            times[label] = best
        found.append((f"{name} {type(layer).__name__[7:]}", times["extend"], times["strips"]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    footer = Footer()
    torch.set_num_threads(1)
    ctx = dl.init(backend=args.backend)
    torch.manual_seed(0)
    grid = TileGrid(ctx.world_size, 1)
    tile = scatter_tiles(torch.randn(1, 3, args.size, args.size), grid, ctx)
    stacks = {"conv3x3": (conv_stack(), [("overlap on", True, True), ("overlap off", True, False)]),
              "stem": (stem_stack(), [("extended", False, False), ("regions", True, False),
                                      ("regions + overlap", True, True)])}
    for name, (model, configs) in stacks.items():
        net = spatialize(model, grid, ctx, image_size=(args.size, args.size))
        rows = time_configs(ctx, net, tile, configs, args.rounds)
        copies = time_copies(ctx, net, tile, args.rounds) if name == "stem" else []
        if ctx.rank == 0:
            print(f"\n{name}: {args.size}x{args.size}, {ctx.world_size} ranks ({grid.rows}x1), "
                  f"plane {ctx.backend}, best of {args.rounds} (slowest rank)")
            table = Table(["configuration", ">forward s", ">forward+backward s",
                           ">halo exchanges in a forward (rank 0) s", ">saved for backward (rank 0) MiB"])
            for label, _, _ in configs:
                forward = max(r[label][0] for r in rows)
                step = max(r[label][1] for r in rows)
                table.add(label, f"{forward:.3f}", f"{step:.3f}", f"{rows[0][label][2]:.4f}",
                          f"{rows[0][label][3] / 2**20:.1f}")
            print(table.markdown())
            if copies:
                table = Table(["layer (rank 0)", ">extended tile built (extend) ms", ">strips only ms",
                               ">copy saved ms"])
                for label, extend, strips in copies:
                    table.add(label, f"{extend * 1e3:.1f}", f"{strips * 1e3:.1f}", f"{(extend - strips) * 1e3:.1f}")
                print(table.markdown())
    ctx.barrier()
    if ctx.rank == 0:
        footer.print()


if __name__ == "__main__":
    main()
