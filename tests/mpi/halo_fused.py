"""Fused halos (halo_d2): equal to the serial model (so to unfused) to 1e-10, border tiles
included, with fewer messages. Usage: python -m tests.mpi.halo_fused ROWS COLS [--backend=gloo].
Named checks: ``check_names()``."""

from __future__ import annotations

import sys

import torch
from torch import nn

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.fused import FusedSequential, halo_messages_sent
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tiles import gather_tiles, scatter_tiles
from tests.support.checks import Checks, run_checks
from tests.support.exactness import check_spatial_exact, relative_error
from tests.support.planes import split_backend
from tests.support.spatial_models import resnet_stack

FUSED_LAYERS = (2, 3, 6)
SIZES = ((64, 64), (100, 120))
RESNET_FUSED = "resnet fused"


def chain() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
        nn.Conv2d(6, 6, 5, padding=2, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(),
        nn.AvgPool2d(3, 1, 1, count_include_pad=False),
        nn.Conv2d(6, 6, (1, 5), padding=(0, 2)), nn.Conv2d(6, 4, 3, stride=2, padding=1),
        nn.ReLU())


def chain_check_names(fused_layers: int, size: tuple[int, int]) -> tuple[str, str]:
    """(exact against serial, equal to unfused with fewer messages) for one chain and size."""
    label = f"fused chain k={fused_layers} {size[0]}x{size[1]}"
    return f"{label}: equals serial", f"{label}: equals unfused with fewer messages"


def check_names() -> list[str]:
    return [name for k in FUSED_LAYERS for size in SIZES for name in chain_check_names(k, size)] + \
        [RESNET_FUSED]


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    backend, args = split_backend(sys.argv[1:])
    rows, cols = int(args[0]), int(args[1])
    ctx = Context(backend=backend)
    grid = TileGrid(rows, cols)
    for fused_layers in FUSED_LAYERS:
        for size in SIZES:
            exact, fewer = chain_check_names(fused_layers, size)
            torch.manual_seed(fused_layers)
            model = chain().double()
            x = torch.randn(2, 3, *size, dtype=torch.float64)
            with check(exact):
                check_spatial_exact(model, grid, x, ctx, halo_d2=True, fused_layers=fused_layers,
                                    what=f"fused chain k={fused_layers} {size}")
            # fused == unfused directly, and fewer messages
            with check(fewer) as result:
                plain = spatialize(model, grid, ctx)
                fused = spatialize(model, grid, ctx, halo_d2=True, fused_layers=fused_layers)
                tile = scatter_tiles(x, grid, ctx)
                a = gather_tiles(plain(tile), grid, ctx)
                b = gather_tiles(fused(tile), grid, ctx)
                counts = torch.tensor([halo_messages_sent(plain), halo_messages_sent(fused)],
                                      dtype=torch.float64)
                ctx.all_reduce(counts)
                assert isinstance(fused, FusedSequential) and len(fused.fused_blocks) >= 1
                assert relative_error(b, a) <= 1e-10, relative_error(b, a)
                assert counts[1] < counts[0], counts
                result.detail = f"forward messages {int(counts[0])} -> {int(counts[1])}"
    with check(RESNET_FUSED):
        torch.manual_seed(5)
        check_spatial_exact(resnet_stack(3, classes=3).double(), grid,
                            torch.randn(2, 3, 64, 64, dtype=torch.float64), ctx, halo_d2=True,
                            fused_layers=3, what="resnet fused")
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
