"""What a whole-slide canvas asks of the layout and the data: sides that cut into tiles of whole trunk strides, a
tissue channel for tissue-mean (checks made before any work), and a note on one canvas per batch under an averaging
pool. Every pool runs on tiles or on one process alike."""
from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from ..config import ConfigError
from ..spatial.geometry import TileGrid
from .pools import PoolKind


def canvas_multiples(grid: TileGrid, stride: int) -> tuple[int, int]:
    """What a canvas's (rows, columns) must be multiples of so that every tile of ``grid`` is whole strides of a
    trunk down-sampling by ``stride`` (its stride product, ``ModelSpec.image_multiple``)."""
    return grid.rows * stride, grid.cols * stride


def check_canvas(image_size: int | tuple[int, int], grid: TileGrid, stride: int) -> None:
    """ConfigError (``--image-size``) unless the canvas cuts into ``grid``'s tiles of whole ``stride``s (the tissue
    mask's area pooling and the pooled feature grid are then exact on tiles), naming the sizes that work."""
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    rows, cols = canvas_multiples(grid, stride)
    if height % rows == 0 and width % cols == 0 and height > 0 and width > 0:
        return
    side = math.lcm(rows, cols)
    below = (min(height, width) // side) * side
    fits = " or ".join(str(n) for n in (below, below + side) if n > 0)
    raise ConfigError("--image-size", f"a {height}x{width} canvas on {grid.rows}x{grid.cols} tiles of a trunk "
                                      f"down-sampling by {stride} leaves tiles that are not whole strides: its "
                                      f"height must be a multiple of {rows} and its width of {cols}; e.g. "
                                      f"--image-size {fits}")


def check_tissue_input(pool: PoolKind, in_channels: int, data_channels: int) -> None:
    """ConfigError (``--pool``) when tissue-mean pooling gets samples without their tissue mask as the last channel
    (``in_channels`` image channels + 1)."""
    if not PoolKind(pool).tissue or data_channels == in_channels + 1:
        return
    raise ConfigError("--pool", f"--pool tissue-mean averages the positions a tissue mask marks, so every sample must "
                                f"carry the mask as its last channel ({in_channels} image channels + 1: whole-slide "
                                f"canvases do), but the data has {data_channels} channels; use --pool avg, max or "
                                f"attention for this data")


def single_canvas_note(pool: PoolKind, batch_size: int, layers: Sequence[nn.Module]) -> str | None:
    """The note for whole slides one canvas per batch under an averaging pool (avg, attention, tissue-mean) with
    BatchNorm in the model: each canvas is then normalised by its own statistics, which takes away much of what such
    a pool reads (how much of the canvas shows the evidence), and on a small cohort it may not learn (measured:
    docs/whole-slide.md, "A recipe that learns"); None otherwise (max pooling learns at batch 1)."""
    has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for layer in layers for m in layer.modules())
    if batch_size > 1 or PoolKind(pool) is PoolKind.MAX or not has_batchnorm:
        return None
    return (f"note: --batch-size 1 with --pool {PoolKind(pool).value}: BatchNorm normalises each canvas by its own "
            f"statistics, which takes away much of what an averaging pool reads; two canvases or more per batch "
            f"(--batch-size 2) learn where one may not (docs/whole-slide.md, 'A recipe that learns')")
