"""Halo exchange: forward equals slicing the padded image (corners included), <Fx, y> = <x, F*y>,
buffers reused, message counts as the geometry says; also a spatialized stack on a sub-group.

Usage: python -m tests.mpi.halo_adjoint ROWS COLS BACKENDS IDLE — BACKENDS: planes run one after the
other in this launch (e.g. ``mpi,gloo``); the first IDLE world ranks hold no tile (the tiles live on a
group of the remaining ranks, as in an engine's spatial stage). Named checks: ``check_names(BACKENDS)``,
reported by the tile ranks.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.halo import HaloExchange
from tests.support.checks import Checks, run_checks
from tests.support.exactness import check_spatial_exact
from tests.support.spatial_models import resnet_stack

# (height, width, kernel, stride, padding, dilation)
LAYERS = [(24, 30, 3, 1, 1, 1), (37, 53, 5, 2, 2, 1), (36, 36, 1, 2, 0, 1),
          (31, 29, (7, 1), 1, (3, 0), 1), (40, 44, 3, 1, 2, 2), (33, 35, 3, 3, 0, 1),
          (30, 30, 4, 2, 1, 1), (30, 34, (1, 3), (2, 1), (0, 1), 1)]
RESNET_ON_GROUP = "resnet on a group"


def layer_check_name(spec: tuple, backend: str) -> str:
    return f"{backend}: halo {spec}: forward, adjoint, buffers, messages"


def check_names(backends: str) -> list[str]:
    return [name for backend in backends.split(",")
            for name in [*(layer_check_name(spec, backend) for spec in LAYERS), f"{backend}: {RESNET_ON_GROUP}"]]


def check_layer(ctx: Context, grid: TileGrid, group, ranks: list[int], tile: int,
                spec: tuple) -> None:
    height, width, kernel, stride, padding, dilation = spec
    geometry = grid.layer_halo(height, width, kernel, stride, padding, dilation, name=str(spec))
    exchange = HaloExchange(geometry, tile, ranks, ctx, pad_value=0.0)
    gen = torch.Generator().manual_seed(11)
    full = torch.randn(2, 3, height, width, generator=gen, dtype=torch.float64)
    view = geometry.tile(tile)
    r0, r1, c0, c1 = view.owned_box
    x = full[..., r0:r1, c0:c1].clone().requires_grad_(True)
    y = exchange(x)
    # forward == the needed box of the zero-padded full image (corners from diagonal tiles)
    a0, a1, b0, b1 = view.needed_box
    pad = max(0, -a0, -b0, a1 - height, b1 - width)
    padded = F.pad(full, (pad, pad, pad, pad))
    expected = padded[..., a0 + pad:a1 + pad, b0 + pad:b1 + pad]
    assert torch.equal(y.detach(), expected), f"rank {ctx.rank}: forward values of {spec}"
    # adjoint: <F x, w> summed over tiles == <x, F* w>
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(100 + tile),
                    dtype=torch.float64)
    y.backward(w)
    lhs = (y.detach() * w).sum().reshape(1)
    rhs = (x.detach() * x.grad).sum().reshape(1)
    both = torch.cat([lhs, rhs])
    ctx.all_reduce(both, group=group)
    assert abs(both[0] - both[1]) <= 1e-12 * abs(both[0]), \
        f"rank {ctx.rank}: adjoint of {spec}: {both[0].item()} vs {both[1].item()}"
    # buffers reused across calls; message count as the geometry says
    before = {k: v.data_ptr() for k, v in exchange.pool.buffers.items()}
    sent = exchange.messages_sent
    exchange(x.detach()).sum()
    after = {k: v.data_ptr() for k, v in exchange.pool.buffers.items()}
    assert before == after, f"rank {ctx.rank}: staging buffers were reallocated"
    mine = [m for m in geometry.messages() if m.src == tile]
    assert exchange.messages_sent - sent == len(mine), \
        f"rank {ctx.rank}: sent {exchange.messages_sent - sent}, geometry says {len(mine)}"


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    rows, cols, backends, idle = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    grid = TileGrid(rows, cols)
    ranks = list(range(idle, idle + grid.num_tiles))
    for backend in backends.split(","):     # one launch for every plane: rank start-up is most of its time
        ctx = Context(backend=backend)
        assert ctx.world_size == idle + grid.num_tiles
        group = ctx.new_group(ranks) if idle else None
        if ctx.rank in ranks:
            tile = ranks.index(ctx.rank)
            for spec in LAYERS:
                with check(layer_check_name(spec, backend)):
                    check_layer(ctx, grid, group, ranks, tile, spec)
            with check(f"{backend}: {RESNET_ON_GROUP}"):
                torch.manual_seed(3)
                model = resnet_stack(3, classes=4).double()
                x = torch.randn(2, 3, 40, 44, dtype=torch.float64)
                check_spatial_exact(model, grid, x, ctx, group, what=f"resnet on a group ({backend})")
        ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
