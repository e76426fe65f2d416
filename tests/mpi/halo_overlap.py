"""MPI (4 ranks): halo overlap and region convs/pools compute exactly what serial computes.

Usage: mpiexec -n 4 python -m tests.mpi.halo_overlap [--backend=gloo]. Named checks:
``overlap <grid>``: a 3x3/5x5 conv stack (banded path) on 2x1 and 1x2 grids, outputs and
every gradient bit-identical with the overlap on and off, and equal to serial.
``regions <stack> <grid>``: strided/dilated convs and max/avg pools (ceil_mode,
count_include_pad both ways) on 2x1, 1x2, 2x2, 3x1 grids with uneven tiles (grids of fewer
than 4 tiles on a sub-group, the other ranks idle): the region path is taken by every
windowed layer, outputs, input and weight gradients equal serial (float64, 1e-12), and are
bit-identical with the overlap on and off; the old extended path (``REGIONS = False``)
equals serial too.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.spatial import conv as spatial_conv
from mpi4dl_nb.spatial.conv import ConvPieces, SpatialConv
from mpi4dl_nb.spatial.convert import reduce_tile_gradients, spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.halo_conv import band_paddings
from mpi4dl_nb.spatial.pool import PoolPieces, SpatialPool
from mpi4dl_nb.spatial.regional import plan_for
from mpi4dl_nb.spatial.tiles import gather_tiles, scatter_tiles
from tests.support.checks import Checks, run_checks

GRIDS = [TileGrid(2, 1), TileGrid(1, 2), TileGrid(2, 2), TileGrid(3, 1)]


def stem() -> nn.Module:
    """ResNet stem and a strided 3x3 / 1x1 / dilated conv; ReLU zeros make max-pool ties."""
    return nn.Sequential(nn.Conv2d(3, 4, 7, stride=2, padding=3), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1, dilation=2), nn.ReLU(),
                         nn.MaxPool2d(3, stride=2, padding=1),
                         nn.Conv2d(4, 4, 3, stride=2, padding=1, bias=False), nn.ReLU(),
                         nn.Conv2d(4, 3, 1, stride=2))


def pools() -> nn.Module:
    """Average pools (3x3/1 with divisor_override, k2s2, ceil_mode, count_include_pad both ways)
    and a ceil-mode max pool."""
    return nn.Sequential(nn.AvgPool2d(3, 1, padding=1, divisor_override=5), nn.AvgPool2d(2, 2),
                         nn.Conv2d(3, 3, 3, stride=2, padding=1), nn.ReLU(),
                         nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True),
                         nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
                         nn.AvgPool2d(2, 2, ceil_mode=True))


STACKS: dict[str, tuple[Callable[[], nn.Module], tuple[int, int]]] = {
    "stem": (stem, (61, 57)), "pools": (pools, (141, 131))}


def check_names() -> list[str]:
    names = ["overlap 2x1", "overlap 1x2"]
    return names + [f"regions {stack} {g.rows}x{g.cols}" for stack in STACKS for g in GRIDS]


def run(model: nn.Module, x: torch.Tensor, grid: TileGrid, ctx, group, overlap: bool, regions: bool = True
        ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], nn.Module]:
    """Output, input gradient and parameter gradients of ``model`` spatialized on ``grid``
    (``regions=False``: strided convs and pools on the extended tile, the old path)."""
    model.zero_grad(set_to_none=True)
    spatial_conv.HALO_OVERLAP, spatial_conv.REGIONS = overlap, regions
    try:
        net = spatialize(model, grid, ctx, group)
        tile = scatter_tiles(x, grid, ctx, group).requires_grad_()
        out = net(tile)
        out.pow(2).sum().backward()
        reduce_tile_gradients(net)
        full = gather_tiles(out.detach(), grid, ctx, group)
        grad_x = gather_tiles(tile.grad, grid, ctx, group)
    finally:
        spatial_conv.HALO_OVERLAP, spatial_conv.REGIONS = False, True
    return full, grad_x, [p.grad.clone() for p in model.parameters()], net


def serial(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = model(x)
    out.pow(2).sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def region_layers(net: nn.Module) -> list[str]:
    """Windowed layers that did NOT take a region or banded path on this tile."""
    missed = []
    for name, layer in net.named_modules():
        if not isinstance(layer, (SpatialConv, SpatialPool)):
            continue
        for exchange in layer._exchanges.values():
            if exchange.identity:
                continue
            if isinstance(layer, SpatialConv):
                if band_paddings(layer, exchange) is None and plan_for(ConvPieces(layer), exchange) is None:
                    missed.append(name)
            elif plan_for(PoolPieces(layer), exchange) is None:
                missed.append(name)
    return missed


def check_regions(ctx, grid: TileGrid, stack: str) -> None:
    build, (height, width) = STACKS[stack]
    torch.manual_seed(1)
    model = build().double()
    x = torch.randn(2, 3, height, width, dtype=torch.float64)
    group = ctx.new_group(list(range(grid.num_tiles))) if grid.num_tiles < ctx.world_size else None
    if ctx.rank >= grid.num_tiles:
        return
    want_out, want_gx, want_gp = serial(model, x)
    on = run(model, x, grid, ctx, group, True)
    off = run(model, x, grid, ctx, group, False)
    extended = run(model, x, grid, ctx, group, False, regions=False)
    missed = region_layers(on[3])
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
    assert all(torch.equal(a, b) for a, b in zip(on[2], off[2]))
    assert close(on[0], want_out), f"output: max err {(on[0] - want_out).abs().max():.3g}"
    assert close(on[1], want_gx), f"input grad: max err {(on[1] - want_gx).abs().max():.3g}"
    for a, b in zip(on[2], want_gp):
        assert close(a, b), f"weight grad: max err {(a - b).abs().max():.3g}"
    assert close(extended[0], want_out) and close(extended[1], want_gx), "extended path"
    assert all(close(a, b) for a, b in zip(extended[2], want_gp)), "extended path: weight grads"
    assert not missed, f"extended path taken by layers {missed}"


def check_banded(ctx, grid: TileGrid) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 5, padding=2)).double()
    x = torch.randn(2, 3, 12, 12, dtype=torch.float64)
    group = ctx.new_group([0, 1])
    if ctx.rank >= 2:
        return
    want_out, want_gx, want_gp = serial(model, x)
    on = run(model, x, grid, ctx, group, True)
    off = run(model, x, grid, ctx, group, False)
    assert torch.equal(on[0], off[0]) and all(torch.equal(a, b) for a, b in zip(on[2], off[2]))
    assert close(on[0], want_out) and close(on[1], want_gx)
    assert all(close(a, b) for a, b in zip(on[2], want_gp))


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    options = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    ctx = dl.init(backend=options.get("backend", "auto"))
    assert ctx.world_size == 4
    for grid in GRIDS[:2]:
        with check(f"overlap {grid.rows}x{grid.cols}"):
            check_banded(ctx, grid)
    for stack in STACKS:
        for grid in GRIDS:
            with check(f"regions {stack} {grid.rows}x{grid.cols}"):
                check_regions(ctx, grid, stack)
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
