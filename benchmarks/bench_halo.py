"""Halo exchange cost vs a raw send/recv of the same bytes, and fused (halo-D2) vs per-layer halos.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/bench_halo.py --size 2048
    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/bench_halo.py --size 2048 --backend gloo

(a) For a 3x3 conv halo of a (1, 16, H/rows, W/cols) float32 tile: time of
HaloExchange forward and forward+backward (adjoint) vs posting the same messages (same
peers, sizes and two-phase order) on preallocated contiguous buffers with no assembly.
Ratio = halo / raw; the exchange also lays the tile into a new extended tensor, a copy
a padded serial conv makes too, so the table also gives F.pad of the tile and halo /
(raw + F.pad), the cost attributable to the exchange itself.
(b) A chain of ``--fused`` 3x3 convs (+ReLU): messages and forward+backward time with one
exchange per layer vs one fused exchange (``halo_d2=True, fused_layers=k``).
Grid: vertical cuts (1 x P). Times are the median over ``--repeats``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from support.machine import Footer
from support.models import conv_stack
from support.tables import Table
from support.timing import median_of, slowest_rank

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.comm.tags import USER
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.fused import halo_messages_sent
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.halo import HaloExchange
from mpi4dl_nb.spatial.tiles import scatter_tiles


def median_time(ctx: Context, run: Callable[[], object], repeats: int) -> float:
    """The slowest rank's median (each run started at a barrier): the slowest rank defines a collective step."""
    return slowest_rank(ctx, median_of(run, repeats, ctx))


def raw_exchange(ctx: Context, exchange: HaloExchange, dtype: torch.dtype, channels: int):
    """Closure posting the exchange's messages on preallocated buffers, phase by phase.

    Tile ``t`` lives on world rank ``t`` in this benchmark.
    """
    geometry, tile = exchange.geometry, exchange.tile
    phases = []
    for phase in ("rows", "cols"):
        sends, recvs = [], []
        for m in geometry.messages(tile):
            if m.phase != phase:
                continue
            r0, r1, c0, c1 = m.box
            if phase == "cols":   # the column phase carries the full needed row range
                r0, r1 = 0, geometry.tile(m.src).rows.needed_len
            buf = torch.empty(1, channels, r1 - r0, c1 - c0, dtype=dtype)
            tag = USER.tag(20 + (phase == "cols"))
            if m.src == tile:
                sends.append((buf, m.dst, tag))
            else:
                recvs.append((buf, m.src, tag))
        phases.append((sends, recvs))

    def run() -> None:
        for sends, recvs in phases:
            requests = [ctx.irecv(b, peer, tag=t) for b, peer, t in recvs]
            requests += [ctx.isend(b, peer, tag=t) for b, peer, t in sends]
            ctx.wait_all(requests)
    return run


def halo_vs_raw(ctx: Context, size: int, channels: int, repeats: int) -> None:
    grid = TileGrid(1, ctx.world_size)
    geometry = grid.layer_halo(size, size, 3, 1, 1)
    exchange = HaloExchange(geometry, ctx.rank, list(range(ctx.world_size)), ctx)
    h, w = grid.tile_of_size(ctx.rank, size, size)
    x = torch.randn(1, channels, h, w)
    raw = raw_exchange(ctx, exchange, x.dtype, channels)
    raw()
    t_raw = median_time(ctx, raw, repeats)
    t_pad = median_time(ctx, lambda: torch.nn.functional.pad(x, (1, 1, 1, 1)), repeats)
    t_fwd = median_time(ctx, lambda: exchange.forward_tensor(x), repeats)
    t_strips = median_time(ctx, lambda: exchange.exchange_strips(x), repeats)
    t_both = median_time(ctx, lambda: exchange.backward_tensor(exchange.forward_tensor(x)),
                         repeats)
    nbytes = sum(m.elements for m in geometry.messages(ctx.rank) if m.src == ctx.rank) \
        * channels * x.element_size()
    if ctx.rank == 0:
        print(f"(a) 3x3 halo, tile {channels}x{h}x{w} float32, {grid}, {ctx.backend} plane, "
              f"{nbytes / 1024:.0f} KiB sent per rank per exchange")
        table = Table(["operation", ">median ms", ">ratio to raw send/recv"])
        table.add("raw isend/irecv of the same messages", f"{t_raw * 1e3:.3f}", "1.00")
        table.add("F.pad of the tile (the copy a padded conv makes anyway)", f"{t_pad * 1e3:.3f}",
                  f"{t_pad / t_raw:.2f}")
        table.add("halo strips only (what a stride-1 SpatialConv2d exchanges)", f"{t_strips * 1e3:.3f}",
                  f"{t_strips / t_raw:.2f}")
        table.add("halo exchange forward, extended tile built", f"{t_fwd * 1e3:.3f}",
                  f"{t_fwd / t_raw:.2f} (vs raw + F.pad: {t_fwd / (t_raw + t_pad):.2f})")
        table.add("halo forward + adjoint backward, extended tile", f"{t_both * 1e3:.3f}",
                  f"{t_both / (2 * t_raw):.2f} (vs 2x raw)")
        print(table.markdown())


def fused_vs_unfused(ctx: Context, size: int, channels: int, layers: int, repeats: int) -> None:
    grid = TileGrid(1, ctx.world_size)
    torch.manual_seed(0)
    model = conv_stack(channels, layers)
    image = torch.randn(1, 3, size, size)
    tile = scatter_tiles(image, grid, ctx)
    rows = []
    for label, kwargs in (("per-layer halos", {}),
                          (f"fused (halo_d2, fused_layers={layers})",
                           {"halo_d2": True, "fused_layers": layers})):
        net = spatialize(model, grid, ctx, image_size=(size, size), **kwargs)

        def step(net: torch.nn.Module = net) -> None:
            net.zero_grad(set_to_none=True)
            net(tile).sum().backward()

        step()
        before = halo_messages_sent(net)
        step()
        per_step = halo_messages_sent(net) - before
        seconds = median_time(ctx, step, repeats)
        total = int(sum(ctx.all_gather_object(per_step)))
        rows.append((label, total, seconds))
    if ctx.rank == 0:
        print(f"(b) {layers} x (3x3 conv {channels}ch + ReLU), {size}x{size}, {grid}, fwd+bwd")
        table = Table(["halos", ">forward messages (all ranks)", ">seconds/step", ">time ratio"])
        for label, total, seconds in rows:
            table.add(label, total, f"{seconds:.3f}", f"{seconds / rows[0][2]:.2f}")
        print(table.markdown())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--fused", type=int, default=4, help="layers in the fused chain")
    parser.add_argument("--chain-size", type=int, default=512, help="image size for (b)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--backend", default="mpi")
    args = parser.parse_args()
    footer = Footer()
    torch.set_num_threads(1)
    ctx = Context(backend=args.backend, trace=False)
    halo_vs_raw(ctx, args.size, args.channels, args.repeats)
    fused_vs_unfused(ctx, args.chain_size, args.channels, args.fused, max(3, args.repeats // 5))
    if ctx.rank == 0:
        footer.print()


if __name__ == "__main__":
    main()
