"""A family added to the conversion table at run time (spatial/families.py): a toy global attention over every pixel,
converted by one ``Family`` entry defined here to a tile version built of the package's ring attention, equal to one
process in float64 on 2x2 and 1x4 (output, input and parameter gradients, BatchNorm buffers, an eval forward), both
passed as ``spatialize(..., families=...)`` and added with ``add_family``; without the entry, refused naming it.

Usage: python -m tests.mpi.family_table   (4 ranks: both grids in one launch)
Named checks: ``check_names()``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.families import FAMILIES, Family, add_family, remove_family
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.layer import Convert, SpatialRuntime, shallow_copy, spatial_class
from mpi4dl_nb.spatial.tile_marks import mark_tiled
from mpi4dl_nb.spatial.tiles import scatter_tiles
from mpi4dl_nb.spatial.tokens.ring import Ring, ring_attention
from tests.support.checks import Checks, run_checks
from tests.support.exactness import check_spatial_exact

RTOL = 1e-10
SIZE = (10, 13)   # uneven tiles on 2x2 and 1x4
GRIDS = ((2, 2), (1, 4))
ADDED = "add_family: every later spatialize converts it (2x2)"
REFUSED = "without the entry: refused naming the module (2x2)"
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]   # (q, k, v) -> attended


class PixelAttention(nn.Module):
    """Global multi-head self-attention over every pixel of an ``(N, C, H, W)`` map: 1x1 projections around
    ``F.scaled_dot_product_attention`` on the flattened pixels (what the op guard refuses on tiles as it is)."""

    def __init__(self, channels: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = nn.Conv2d(channels, channels, 1)

    def attend(self, qkv: torch.Tensor, attention: Attention) -> torch.Tensor:
        """``attention(q, k, v)`` of the heads of ``qkv`` ``(N, 3C, h, w)``; ``(N, C, h, w)``."""
        n, _, h, w = qkv.shape
        q, k, v = (t.transpose(1, 2).reshape(n, h * w, self.heads, -1).transpose(1, 2)
                   for t in qkv.flatten(2).chunk(3, dim=1))
        out = attention(q, k, v)
        return out.transpose(1, 2).reshape(n, h * w, -1).transpose(1, 2).reshape(n, -1, h, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.attend(self.qkv(x), F.scaled_dot_product_attention))


class TilePixelAttention(nn.Module):
    """Mixin: ``PixelAttention`` on this rank's tile: its projections spatial layers, the attention a ring over the
    tile group (every tile's pixels are keys of every query)."""

    tile_runtime: SpatialRuntime
    qkv: nn.Module
    proj: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        runtime = self.tile_runtime
        qkv = self.qkv(x)
        sizes = runtime.axis_sizes(self, qkv)   # the map's (H, W)
        counts = tuple((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in runtime.grid.tile_boxes(sizes[0], sizes[1]))
        ring = Ring(runtime.ctx, runtime.group, counts, name="pixel attention")
        assert isinstance(self, PixelAttention)
        with torch._C.DisableTorchFunction():
            out = self.attend(qkv, lambda q, k, v: ring_attention(q, k, v, ring))
        return self.proj(mark_tiled(out))


def convert_pixel_attention(module: nn.Module, name: str, runtime: SpatialRuntime, convert: Convert) -> nn.Module:
    """The toy family's conversion: a ``TilePixelAttention`` sharing the module's state, its convs converted."""
    new = shallow_copy(module, spatial_class(TilePixelAttention, type(module)))
    object.__setattr__(new, "tile_runtime", runtime)
    for child_name, child in module.named_children():
        new._modules[child_name] = convert(child, f"{name}.{child_name}")
    return new


TOY = Family("toy pixel attention (tests/mpi/family_table.py)", lambda module: type(module) is PixelAttention,
             convert_pixel_attention, "tests/mpi/family_table.py")


def model() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), PixelAttention(8, 2),
                         nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1)).double()


def exact_name(rows: int, cols: int) -> str:
    return f"toy pixel attention exact on {rows}x{cols}"


def check_names() -> list[str]:
    return [*(exact_name(r, c) for r, c in GRIDS), ADDED, REFUSED]


def worst(errors: dict[str, float]) -> str:
    return f"worst rel err {max(errors.values()):.2e}"


def refused(ctx: Context, grid: TileGrid, x: torch.Tensor) -> str:
    net = spatialize(model(), grid, ctx, families=FAMILIES)
    try:
        net(scatter_tiles(x, grid, ctx))
    except ConfigError as error:
        assert "PixelAttention" in str(error), str(error)
        return f"ConfigError: {str(error)[:100]}..."
    raise AssertionError("no ConfigError")


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = Context()
    assert ctx.world_size == 4, "run with 4 ranks"
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(63), dtype=torch.float64)
    for rows, cols in GRIDS:
        with check(exact_name(rows, cols)) as result:
            result.detail = worst(check_spatial_exact(model(), TileGrid(rows, cols), x, ctx, rtol=RTOL,
                                                      families=(TOY, *FAMILIES)))
    with check(ADDED) as result:
        add_family(TOY)
        try:
            result.detail = worst(check_spatial_exact(model(), TileGrid(2, 2), x, ctx, rtol=RTOL))
        finally:
            remove_family(TOY)
    with check(REFUSED) as result:
        result.detail = refused(ctx, TileGrid(2, 2), x)
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
