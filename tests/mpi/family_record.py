"""A family added as one record at run time, in a model that models/ cuts: the toy pixel attention of
tests/mpi/family_table.py (its record ``TOY``) inside a model with a forward of its own, cut into pieces by
``models.cut.layer_list`` and the pieces spatialized with the record added by ``add_family``: equal to the model on one
process in float64 on 2x2 and 1x4 (output, input and parameter gradients, BatchNorm buffers, an eval forward).

Usage: python -m tests.mpi.family_record   (4 ranks: both grids in one launch)
Named checks: ``check_names()``.
"""

from __future__ import annotations

import torch
from torch import nn

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.models.cut import layer_list
from mpi4dl_nb.spatial.families import add_family, remove_family
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.mpi.family_table import TOY, PixelAttention, worst
from tests.support.checks import Checks, run_checks
from tests.support.exactness import check_spatial_exact

RTOL = 1e-10
SIZE = (10, 13)   # uneven tiles on 2x2 and 1x4
GRIDS = ((2, 2), (1, 4))


class AttentionBlock(nn.Module):
    """``x + attention(x)``: the toy attention with a residual add."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.attention = PixelAttention(channels, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attention(x)


class AttendingNet(nn.Module):
    """A model of one's own: a conv stem, an attention block, a ReLU call and a conv head (no ``nn.Sequential``:
    ``layer_list`` traces its forward into pieces)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = AttentionBlock(8)
        self.head = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.block(self.stem(x))))


def model() -> nn.Module:
    torch.manual_seed(7)
    return AttendingNet().double()


def cut(net: nn.Module) -> nn.Sequential:
    """``net`` as models/ cuts it: its pieces, checked equal to it, chained."""
    pieces = layer_list(net, check_size=12)
    assert len(pieces) > 2 and any(isinstance(m, PixelAttention) for p in pieces for m in p.modules()), pieces
    return nn.Sequential(*pieces)


def exact_name(rows: int, cols: int) -> str:
    return f"toy family's model cut by models/ and spatialized, exact on {rows}x{cols}"


def check_names() -> list[str]:
    return [exact_name(r, c) for r, c in GRIDS]


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = Context()
    assert ctx.world_size == 4, "run with 4 ranks"
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(78), dtype=torch.float64)
    reference = model()
    pieces = cut(reference)
    add_family(TOY)
    try:
        for rows, cols in GRIDS:
            with check(exact_name(rows, cols)) as result:
                result.detail = worst(check_spatial_exact(pieces, TileGrid(rows, cols), x, ctx, rtol=RTOL))
    finally:
        remove_family(TOY)
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
