"""Fused halos (halo_d2): equal to the serial model (so to unfused) to 1e-10, border tiles
included, with fewer messages. Usage: python -m tests.mpi.halo_fused ROWS COLS [--backend=gloo].
Named checks: ``check_names()``.

Volumes: python -m tests.mpi.halo_fused DEPTH ROWS COLS PLANES (e.g. ``2 2 2 mpi,gloo``: every plane in one
launch): a chain of 3-D layers fused 2 and 3 at a time on an uneven volume, output and every gradient equal to
one process (1e-10), equal to unfused with fewer messages, each block's three-phase exchange sending the
messages its geometry lists. Named checks: ``volume_check_names(PLANES)``."""

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
VOLUME_FUSED_LAYERS = (2, 3)
VOLUME_SIZE = (12, 11, 13)   # uneven on a 2x2x2 grid; 6x6x7 after the stride-2 pool (3 positions per tile)


def chain() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
        nn.Conv2d(6, 6, 5, padding=2, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(),
        nn.AvgPool2d(3, 1, 1, count_include_pad=False),
        nn.Conv2d(6, 6, (1, 5), padding=(0, 2)), nn.Conv2d(6, 4, 3, stride=2, padding=1),
        nn.ReLU())


def volume_chain() -> nn.Module:
    """Every fusable 3-D layer kind: convolutions (bias-free before BatchNorm3d, a flat (1, 3, 3) kernel),
    a strided max pool, an average pool dividing by in-volume counts."""
    return nn.Sequential(
        nn.Conv3d(2, 3, 3, padding=1, bias=False), nn.BatchNorm3d(3), nn.ReLU(),
        nn.Conv3d(3, 3, 3, padding=1), nn.ReLU(),
        nn.MaxPool3d(3, 2, 1),
        nn.Conv3d(3, 3, 3, padding=1, bias=False), nn.BatchNorm3d(3), nn.ReLU(),
        nn.AvgPool3d(3, 1, 1, count_include_pad=False),
        nn.Conv3d(3, 2, (1, 3, 3), padding=(0, 1, 1)))


def volume_check_names(planes: str) -> list[str]:
    return [f"{plane}: fused volume k={k}: {what}" for plane in planes.split(",") for k in VOLUME_FUSED_LAYERS
            for what in ("equals serial", "equals unfused with fewer messages")]


def check_volumes(check: Checks, grid: TileGrid, planes: str) -> None:
    for plane in planes.split(","):     # one launch for every plane: rank start-up is most of its time
        ctx = Context(backend=plane)
        for fused_layers in VOLUME_FUSED_LAYERS:
            label = f"{plane}: fused volume k={fused_layers}"
            torch.manual_seed(fused_layers)
            model = volume_chain().double()
            x = torch.randn(2, 2, *VOLUME_SIZE, dtype=torch.float64)
            with check(f"{label}: equals serial"):
                check_spatial_exact(model, grid, x, ctx, halo_d2=True, fused_layers=fused_layers, what=label)
            with check(f"{label}: equals unfused with fewer messages") as result:
                plain = spatialize(model, grid, ctx)
                fused = spatialize(model, grid, ctx, halo_d2=True, fused_layers=fused_layers)
                tile = scatter_tiles(x, grid, ctx)
                a = gather_tiles(plain(tile), grid, ctx)
                b = gather_tiles(fused(tile), grid, ctx)
                counts = torch.tensor([halo_messages_sent(plain), halo_messages_sent(fused)], dtype=torch.float64)
                ctx.all_reduce(counts)
                assert isinstance(fused, FusedSequential) and len(fused.fused_blocks) >= 1
                assert relative_error(b, a) <= 1e-10, relative_error(b, a)
                assert counts[1] < counts[0], counts
                for block in fused.fused_blocks.values():
                    for plan in block._plans.values():
                        listed = [m for m in plan.geometry.messages(ctx.rank) if m.src == ctx.rank]
                        assert plan.exchange.messages_sent == len(listed), (block.name, plan.exchange.messages_sent,
                                                                            len(listed))
                result.detail = (f"{len(fused.fused_blocks)} blocks, forward messages {int(counts[0])} -> "
                                 f"{int(counts[1])}")
        ctx.barrier()


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
    if len(args) == 4:
        check_volumes(check, TileGrid(depth=int(args[0]), rows=int(args[1]), cols=int(args[2])), args[3])
        return
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
