"""Tile marks: which tensors hold this rank's tile of an image, and where a tile keeps its rows and columns."""

from __future__ import annotations

from typing import TypeGuard, TypeVar

import torch

from .tile_layout import STANDARD, Axis, TileDim, TileLayout

T = TypeVar("T")

MARK = "_mpi4dl_tile"


def is_tiled(t: object) -> TypeGuard[torch.Tensor]:
    """Whether ``t`` holds this rank's tile of an image-sized tensor (set during a spatial forward)."""
    return isinstance(t, torch.Tensor) and isinstance(t.__dict__.get(MARK), TileLayout)


def layout_of(t: torch.Tensor) -> TileLayout:
    """Where the tile ``t`` keeps the image's rows and columns (``STANDARD`` when unmarked)."""
    layout = t.__dict__.get(MARK)
    return layout if isinstance(layout, TileLayout) else STANDARD


def mark_tiled(obj: T, layout: TileLayout = STANDARD) -> T:
    """Mark every tensor in ``obj`` (a tensor or nested tuples/lists) as a tile laid out as ``layout``;
    returns ``obj``."""
    if isinstance(obj, torch.Tensor):
        obj.__dict__[MARK] = layout
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            mark_tiled(item, layout)
    return obj


def any_tiled(obj: object) -> bool:
    """Whether ``obj`` (a tensor, or nested tuples/lists/dicts of them) holds a tile."""
    if isinstance(obj, torch.Tensor):
        return is_tiled(obj)
    if isinstance(obj, (tuple, list)):
        return any(any_tiled(item) for item in obj)
    if isinstance(obj, dict):
        return any(any_tiled(item) for item in obj.values())
    return False


def first_layout(obj: object) -> TileLayout:
    """The layout of the first tile in ``obj`` (nested tuples/lists/dicts), ``STANDARD`` if none."""
    if isinstance(obj, torch.Tensor):
        return layout_of(obj)
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    for item in items:
        if any_tiled(item):
            return first_layout(item)
    return STANDARD


def tile_sizes(tile: torch.Tensor, sizes: torch.Size) -> torch.Size:
    """``sizes`` (the tile's shape) with its row and column counts as ``TileDim``."""
    layout = layout_of(tile)
    if layout.flat or not layout.fits(len(sizes)):
        return sizes
    out = list(sizes)
    for offset, axis in ((layout.rows, Axis.ROWS), (layout.cols, Axis.COLS)):
        out[offset] = TileDim(sizes[offset], axis)
    return torch.Size(out)


def tensors_out(out: object) -> list[torch.Tensor]:
    """The tensors an op returned: ``out`` itself, or the tensors of a returned tuple or list."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, torch.Tensor)]
    return []


def mark_outputs(out: T) -> T:
    """Mark the tensors an op returned (not those nested deeper) as tiles in the standard layout; returns ``out``."""
    for t in tensors_out(out):
        t.__dict__[MARK] = STANDARD
    return out
