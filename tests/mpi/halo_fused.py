"""Fused halos (halo_d2): equal to the serial model (so to unfused) to 1e-10, border tiles
included, with fewer messages. Usage: python -m tests.mpi.halo_fused ROWS COLS."""

from __future__ import annotations

import sys

import torch
from torch import nn

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.fused import FusedSequential
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tiles import gather_tiles, scatter_tiles
from tests.support.exactness import check_spatial_exact, relative_error
from tests.support.spatial_models import resnet_stack

torch.set_num_threads(1)


def chain() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
        nn.Conv2d(6, 6, 5, padding=2, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(),
        nn.AvgPool2d(3, 1, 1, count_include_pad=False),
        nn.Conv2d(6, 6, (1, 5), padding=(0, 2)), nn.Conv2d(6, 4, 3, stride=2, padding=1),
        nn.ReLU())


def messages(net: nn.Module) -> int:
    total = 0
    for module in net.modules():
        for exchange in getattr(module, "_exchanges", {}).values():
            total += exchange.messages_sent
        for block in getattr(module, "_fused_blocks", {}).values():
            total += sum(p.exchange.messages_sent for p in block._plans.values())
    return total


def main() -> None:
    rows, cols = int(sys.argv[1]), int(sys.argv[2])
    ctx = Context()
    grid = TileGrid(rows, cols)
    for fused_layers in (2, 3, 6):
        for size in ((64, 64), (100, 120)):
            torch.manual_seed(fused_layers)
            model = chain().double()
            x = torch.randn(2, 3, *size, dtype=torch.float64)
            check_spatial_exact(model, grid, x, ctx, halo_d2=True, fused_layers=fused_layers,
                                what=f"fused chain k={fused_layers} {size}")
            # fused == unfused directly, and fewer messages
            plain = spatialize(model, grid, ctx)
            fused = spatialize(model, grid, ctx, halo_d2=True, fused_layers=fused_layers)
            assert isinstance(fused, FusedSequential) and len(fused._fused_blocks) >= 1
            tile = scatter_tiles(x, grid, ctx)
            a = gather_tiles(plain(tile), grid, ctx)
            b = gather_tiles(fused(tile), grid, ctx)
            assert relative_error(b, a) <= 1e-10, relative_error(b, a)
            counts = torch.tensor([messages(plain), messages(fused)], dtype=torch.float64)
            ctx.all_reduce(counts)
            assert counts[1] < counts[0], counts
            if ctx.rank == 0 and size == (100, 120):
                print(f"fused_layers={fused_layers}: forward messages {int(counts[0])} -> "
                      f"{int(counts[1])}")
    torch.manual_seed(5)
    check_spatial_exact(resnet_stack(3, classes=3).double(), grid,
                        torch.randn(2, 3, 64, 64, dtype=torch.float64), ctx, halo_d2=True,
                        fused_layers=3, what="resnet fused")
    ctx.barrier()
    if ctx.rank == 0:
        print(f"OK fused {grid}")


if __name__ == "__main__":
    main()
