"""MPI (2 ranks): halo overlap (spatial.conv.HALO_OVERLAP) computes exactly what the plain order computes.

Usage: python -m tests.mpi.halo_overlap [--backend=gloo]. Named check ``overlap <grid>``: a
3x3 conv stack (banded path) on 2x1 and 1x2 grids, float64, forward outputs and every
gradient bit-identical with the overlap on and off, and equal to the serial model.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.spatial import conv as spatial_conv
from mpi4dl_nb.spatial.convert import reduce_tile_gradients, spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tiles import gather_tiles, scatter_tiles
from tests.support.checks import Checks, run_checks


def run(ctx, grid: TileGrid, overlap: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 5, padding=2)).double()
    x = torch.randn(2, 3, 12, 12, dtype=torch.float64)
    spatial_conv.HALO_OVERLAP = overlap
    try:
        net = spatialize(model, grid, ctx)
        out = gather_tiles(net(scatter_tiles(x, grid, ctx)), grid, ctx)
        out.pow(2).sum().backward()
        reduce_tile_gradients(net)
    finally:
        spatial_conv.HALO_OVERLAP = False
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    options = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    ctx = dl.init(backend=options.get("backend", "auto"))
    for grid in (TileGrid(2, 1), TileGrid(1, 2)):
        with check(f"overlap {grid.rows}x{grid.cols}"):
            out_on, grads_on = run(ctx, grid, True)
            out_off, grads_off = run(ctx, grid, False)
            assert torch.equal(out_on, out_off)
            assert all(torch.equal(a, b) for a, b in zip(grads_on, grads_off))
            torch.manual_seed(0)
            model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 5, padding=2)).double()
            x = torch.randn(2, 3, 12, 12, dtype=torch.float64)
            want = model(x)
            want.pow(2).sum().backward()
            assert torch.allclose(out_on, want, rtol=1e-12, atol=1e-12)
            assert all(torch.allclose(a, p.grad, rtol=1e-10, atol=1e-12) for a, p in zip(grads_on, model.parameters()))
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
