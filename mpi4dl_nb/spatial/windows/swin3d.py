"""A 3-D Swin model's window blocks and patch merging on a volume's tiles (``models/swin3d.py``), exactly.
More: docs/spatial.md#notes-by-module."""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
from torch import nn

from ...errors import ConfigError
from ..family import Family, names_family
from ..layer import Convert, SpatialLayer, SpatialRuntime, adopt
from .exchange import TokenExchange
from .masks import RegionMask
from .plan import ShiftedWindows, TokenBoxes, WindowLayout, plan_merge

Sides = tuple[int, ...]
MERGE_ORDER = list(itertools.product((0, 1), repeat=3))   # the model's 2x2x2 concatenation: the last axis fastest


class VolumeWindowBlock(Protocol):
    """What a window block of ``models/swin3d.py`` offers its tile version."""

    norm1: nn.Module
    norm2: nn.Module
    mlp: nn.Module
    attn: Callable[[torch.Tensor, Sides, torch.Tensor | None], torch.Tensor]

    def windowing(self, grid: tuple[int, int, int]) -> tuple[Sides, Sides]: ...


class MergeLayer(Protocol):
    """What a patch merging layer of ``models/swin3d.py`` offers its tile version."""

    norm: nn.Module
    reduction: nn.Module


@dataclass(frozen=True)
class VolumeWindowPlan:
    """One tile's windows of a block on a token grid: the gathers into its windows and back, and their mask."""

    window: Sides
    area: int
    owned: int
    into: TokenExchange
    back: TokenExchange
    region_mask: RegionMask | None   # of the (owned, area) region labels; None when nothing is shifted

    def mask(self, like: torch.Tensor) -> torch.Tensor | None:
        """``(owned, area, area)``: Swin's mask of this tile's windows (None unshifted or without windows)."""
        return None if self.region_mask is None or not self.owned else self.region_mask.like(like)


def volume_window_plan(runtime: SpatialRuntime, sizes: Sides, window: Sides, shift: Sides) -> VolumeWindowPlan:
    """This tile's ``VolumeWindowPlan`` for windows of ``window`` shifted by ``shift`` on a ``sizes`` grid (cached)."""
    key = ("swin3d windows", sizes, window, shift)
    plan = runtime.plans.get(key)
    if not isinstance(plan, VolumeWindowPlan):
        windows = ShiftedWindows(sizes, window, shift)
        layout = WindowLayout(windows, TokenBoxes(runtime.grid, sizes))
        tile = runtime.tile
        mask = RegionMask(torch.tensor(layout.labels(tile), dtype=torch.long)) if windows.shifted else None
        plan = VolumeWindowPlan(window, windows.area, len(layout.owned(tile)),
                          TokenExchange(layout.into_windows()[tile], runtime.ctx, runtime.ranks, runtime.group),
                          TokenExchange(layout.out_of_windows()[tile], runtime.ctx, runtime.ranks, runtime.group),
                          mask)
        runtime.plans[key] = plan
    return plan


def merge_exchange(runtime: SpatialRuntime, sizes: Sides) -> TokenExchange:
    """This tile's gather of every 2x2x2 group of a ``sizes`` grid to its merged token's tile (cached)."""
    key = ("swin3d merge", sizes)
    exchange = runtime.plans.get(key)
    if not isinstance(exchange, TokenExchange):
        plan = plan_merge(TokenBoxes(runtime.grid, sizes), MERGE_ORDER)[runtime.tile]
        exchange = runtime.plans[key] = TokenExchange(plan, runtime.ctx, runtime.ranks, runtime.group)
    return exchange


def _grid(sizes: tuple[int, ...]) -> tuple[int, int, int]:
    return (sizes[0], sizes[1], sizes[2])


class SpatialWindowBlock(SpatialLayer, nn.Module):
    """A (shifted) window block on a volume's tile: per-token parts on the tile, each window on its owner tile."""

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        block: VolumeWindowBlock = self   # type: ignore[assignment]   # bound to the model's block class
        sizes = _grid(self.runtime.axis_sizes(self, x))
        plan = volume_window_plan(self.runtime, sizes, *block.windowing(sizes))
        tokens = x.permute(0, 2, 3, 4, 1)                                  # (N, d, h, w, C): this tile's tokens
        n, c = tokens.shape[0], tokens.shape[-1]
        windows = plan.into(block.norm1(tokens).reshape(n, -1, c)).reshape(n * plan.owned, plan.area, c)
        attended = block.attn(windows, plan.window, plan.mask(windows))
        tokens = tokens + plan.back(attended.reshape(n, plan.owned * plan.area, c)).reshape(tokens.shape)
        tokens = tokens + block.mlp(block.norm2(tokens))
        return tokens.permute(0, 4, 1, 2, 3)


class SpatialPatchMerge(SpatialLayer, nn.Module):
    """2x2x2 patch merging on a volume's tile: each group gathered to its merged token's tile, merged there."""

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        merge: MergeLayer = self   # type: ignore[assignment]   # bound to the model's merging class
        sizes = self.runtime.axis_sizes(self, x)
        if any(n % 2 for n in sizes):
            raise ConfigError("model", f"layer {self.layer_name!r} merges 2x2x2 tokens of a {sizes} grid: every side "
                                       f"must be even (choose --image-size sides divisible by the model's stride)")
        merged = TokenBoxes(self.runtime.grid, tuple(n // 2 for n in sizes)).lengths(self.runtime.tile)
        n, c = x.shape[0], x.shape[1]
        groups = merge_exchange(self.runtime, sizes)(x.permute(0, 2, 3, 4, 1).reshape(n, -1, c))
        out = merge.reduction(merge.norm(groups.reshape(n, *merged, 8 * c)))
        return out.permute(0, 4, 1, 2, 3)


def _on_volume(kind: type[SpatialWindowBlock | SpatialPatchMerge], module: nn.Module, name: str,
               runtime: SpatialRuntime, _: Convert) -> nn.Module:
    """``module`` (a 3-D Swin window block or patch merge) as ``kind`` on a volume's tiles; each parameter's gradient
    on a rank is its own tokens' and windows' share. Refused on an image's grid."""
    if not runtime.grid.volumetric:
        raise ConfigError("model", f"layer {name or '<root>'!r} ({type(module).__name__}) is not supported on image "
                          f"tiles: a 3-D Swin block or patch merge runs on a volume's tiles (a TileGrid with depth); "
                          f"or put it after the spatial stage")
    for parameter in module.parameters():
        runtime.claim_tile_share(parameter)
    return adopt(kind, module, runtime, name)


# a 3-D Swin model's classes (models/swin3d.py's) name these as their tile_family; a block offers what
# ``VolumeWindowBlock`` says, a merge what ``MergeLayer`` says
VOLUME_WINDOW_BLOCK: Family = Family("3-D Swin (models/swin3d.py's window blocks)", lambda module: names_family(
    module, VOLUME_WINDOW_BLOCK), partial(_on_volume, SpatialWindowBlock), "tests/mpi/spatial3d.py")
VOLUME_PATCH_MERGE: Family = Family("3-D Swin (models/swin3d.py's patch merging)", lambda module: names_family(
    module, VOLUME_PATCH_MERGE), partial(_on_volume, SpatialPatchMerge), "tests/mpi/spatial3d.py")
