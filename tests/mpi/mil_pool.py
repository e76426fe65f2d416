"""The slide-level pools on tiles (issue 43): max, attention-MIL and tissue-mean heads float64-exact against one
process in forward and every gradient (input, parameters, BatchNorm buffers; eval forward too), on uneven tiles;
max pooling with constructed ties across tiles; ``softmax_pool`` with replicated scores refused by the op guard.

Usage: python -m tests.mpi.mil_pool ROWS COLS
Named checks: ``check_names()``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.models.head import ClassifierHead
from mpi4dl_nb.models.pools import AttentionMILPool, GlobalMaxPool, PoolKind
from mpi4dl_nb.models.tissue import carry_tissue
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.mil_pool import softmax_pool
from mpi4dl_nb.spatial.tiles import scatter_tiles
from tests.support.checks import Checks, run_checks
from tests.support.exactness import check_spatial_exact

RTOL = 1e-10
SIZE = (26, 30)        # uneven tiles on every grid; 13x15 after the stride-2 layer
TIES = "max pool: ties across tiles go to the first maximum in row-major order"
MANY_TIES = "max pool: every channel tied many times"
PEAKED = "attention pool: peaked scores (softmax merged across tiles without overflow)"
REFUSED = "refuses softmax_pool with replicated scores"
BY_HAND = "refuses a softmax over the positions written by hand (not silently wrong)"


def trunk() -> list[nn.Module]:
    """conv-BN-ReLU, then a stride-2 conv: 6 channels at half the size."""
    return [nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
            nn.Conv2d(4, 6, 3, stride=2, padding=1)]


def head_model(kind: PoolKind) -> tuple[nn.Module, int]:
    """The trunk and a ClassifierHead pooling as ``kind`` (BN-ReLU first); the input's channels."""
    layers = trunk()
    channels = 3
    if kind.tissue:
        layers = carry_tissue(layers, 3, 4)
        channels = 4
    return nn.Sequential(*layers, ClassifierHead(6, 3, norm=True, relu=True, pool=kind)), channels


def inputs(channels: int, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(2, channels, *SIZE, generator=generator, dtype=torch.float64)
    if channels == 4:   # a tissue mask, not all tissue
        x[:, 3] = (torch.rand(2, *SIZE, generator=generator) > 0.4).double()
    return x


def exact_name(kind: PoolKind) -> str:
    return f"{kind} head exact"


def check_names() -> list[str]:
    return [*(exact_name(k) for k in PoolKind if k is not PoolKind.AVG), TIES, MANY_TIES, PEAKED, REFUSED, BY_HAND]


def exact(model: nn.Module, grid: TileGrid, x: torch.Tensor, ctx: Context, what: str) -> str:
    errors = check_spatial_exact(model.double(), grid, x, ctx, what=what, rtol=RTOL, grad_floor=1e-2)
    return f"worst rel err {max(errors.values()):.2e}"


def tied_input() -> torch.Tensor:
    """Zeros with three equal maxima per channel: in the bottom-right, top-right and left part of the image; the
    first in row-major order (row 3) is not in the first tile that holds one on a row-major tile grid."""
    x = torch.zeros(2, 3, *SIZE, dtype=torch.float64)
    for row, col in ((20, 25), (10, 2), (3, 28)):
        x[..., row, col] = 5.0
    return x


class ReplicatedScores(nn.Module):
    """A custom forward pooling a tile with scores computed from a global pool (replicated): refused."""

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return softmax_pool(y, y.mean((2, 3), keepdim=True)[:, :1])


class HandWritten(nn.Module):
    """Attention pooling written with torch ops: the softmax over the flattened positions of a tile."""

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return (y.flatten(2) * torch.softmax(y[:, :1].flatten(2), -1)).sum(-1)


def check_refused(ctx: Context, grid: TileGrid, module: nn.Module, shown: str) -> str:
    net = spatialize(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), module).double(), grid, ctx)
    x = torch.randn(2, 3, *SIZE, dtype=torch.float64)
    try:
        net(scatter_tiles(x, grid, ctx))
    except ConfigError as error:
        assert shown in str(error) and type(module).__name__ in str(error), str(error)
        return f"ConfigError: {str(error)[:100]}..."
    raise AssertionError("no ConfigError")


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    rows, cols = (int(a) for a in sys.argv[1:3])
    ctx = Context()
    grid = TileGrid(rows, cols)
    assert ctx.world_size == grid.num_tiles, "run with rows*cols ranks"
    generator = torch.Generator().manual_seed(43)
    for kind in PoolKind:
        if kind is PoolKind.AVG:
            continue
        with check(exact_name(kind)) as result:
            torch.manual_seed(len(kind))
            model, channels = head_model(kind)
            result.detail = exact(model, grid, inputs(channels, generator), ctx, str(kind))
    cases: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
        TIES: lambda: (GlobalMaxPool(), tied_input()),
        MANY_TIES: lambda: (GlobalMaxPool(), torch.randint(0, 3, (2, 3, *SIZE), generator=generator).double()),
        PEAKED: lambda: (nn.Sequential(*trunk(), AttentionMILPool(6, 5)), 40 * inputs(3, generator)),
    }
    for name, make in cases.items():
        with check(name) as result:
            torch.manual_seed(7)
            model, x = make()
            result.detail = exact(model, grid, x, ctx, name)
    with check(REFUSED) as result:
        result.detail = check_refused(ctx, grid, ReplicatedScores(), "mil_pool.softmax_pool")
    with check(BY_HAND) as result:
        result.detail = check_refused(ctx, grid, HandWritten(), "softmax")
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
