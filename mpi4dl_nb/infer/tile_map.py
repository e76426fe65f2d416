"""``--map-mode tiles``: every output cell is the classifier applied to exactly the tile the cell names, as it was
trained (the tile alone, zero padding at its own borders), rows of cells shared among the ranks; a cell whose tile
does not lie wholly on the slide holds no data (NaN).

The dense mode computes the same cells fully convolutionally: faster (each pixel's features computed once), but a
cell's features see the slide around its tile, which no training tile had. ``auto`` (the default) is dense for a
network with a fully convolutional form (``infer/fully_conv.py``), tiles otherwise. Both modes share the cell grid
(cell ``j`` covers pixels ``[j*stride, j*stride + extent)`` at the resolution read), so every output lines up the
same way.

A classifier that sees each tile as a whole (a transformer's attention: ViT, Swin, MaxViT, EfficientViT; any head
that is not a global pool then per-vector layers) has no fully convolutional form: it maps in tiles mode only.
Its ``FullyConvolutional`` is ``cell_grid``'s, the geometry of its cells alone, whose values nothing uses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..config import Choice, ConfigError
from ..spatial.geometry import Box
from .fully_conv import FullyConvolutional, classifies, meta_output_shape, network_shape


class MapMode(Choice):
    """How output cells are computed: ``auto`` (the default: dense when the network has a fully convolutional form,
    else tiles), ``dense`` (fully convolutional) or ``tiles`` (each tile alone)."""

    AUTO = "auto"
    DENSE = "dense"
    TILES = "tiles"


def chosen_map_mode(asked: MapMode, lone_tiles: bool) -> MapMode:
    """The mode a map runs in: ``asked``, or for ``auto`` tiles when the classifier maps lone tiles only (no fully
    convolutional form, ``lone_tiles``), else dense."""
    if asked != MapMode.AUTO:
        return MapMode(asked)
    return MapMode.TILES if lone_tiles else MapMode.DENSE


def auto_choice_text(chosen: MapMode, model: str) -> str:
    """The one line saying what ``--map-mode auto`` chose for ``model`` and why."""
    why = ("it sees each tile as a whole, so no fully convolutional form exists; each cell is the classifier on its "
           "lone tile" if chosen == MapMode.TILES else "it has a fully convolutional form")
    return f"--map-mode auto: {chosen} for {model} ({why}); --map-mode dense|tiles chooses"


@dataclass(frozen=True)
class TileGeometry:
    """The cells of a ``read_shape`` image: ``extent``-pixel tiles every ``stride`` pixels, ``cells`` per axis."""

    extent: int
    stride: int
    cells: tuple[int, int]
    read_shape: tuple[int, int]

    def whole(self, axis: int) -> int:
        """Cells along ``axis`` whose tile lies wholly on the image."""
        fits = (self.read_shape[axis] - self.extent) // self.stride + 1
        return max(0, min(self.cells[axis], fits))

    def tile(self, row: int, col: int) -> Box:
        """The pixels (rows, then columns) of cell ``(row, col)``'s tile."""
        r0, c0 = row * self.stride, col * self.stride
        return (r0, r0 + self.extent, c0, c0 + self.extent)


class TileClassifier:
    """The trained classifier on lone tiles: probabilities per class (softmax of its logits)."""

    def __init__(self, layers: Sequence[nn.Module], dtype: torch.dtype, device: torch.device) -> None:
        self.net = nn.Sequential(*layers).to(device=device, dtype=dtype).eval()
        self.dtype, self.device = dtype, device

    def row(self, read: Callable[[Box], torch.Tensor], geometry: TileGeometry, row: int, classes: int,
            batch: int) -> np.ndarray:
        """Cell row ``row``: (classes, 1, cells) probabilities, NaN where the tile leaves the image. ``read``: a
        box's pixels as the network takes them ((3, h, w) in [0, 1], stain-normalised as in training)."""
        out = np.full((classes, 1, geometry.cells[1]), np.nan, dtype=np.float64)
        for start, stop in _chunks(geometry.whole(1), batch):
            pixels = torch.stack([read(geometry.tile(row, col)) for col in range(start, stop)])
            pixels = pixels.to(self.device, self.dtype)
            with torch.no_grad():
                probabilities = torch.softmax(self.net(pixels), dim=1).double().cpu().numpy()
            out[:, 0, start:stop] = probabilities.T
        return out


def lone_tile_classes(layers: Sequence[nn.Module], patch: int | None, channels: int = 3) -> int | None:
    """The class count of ``layers`` when they classify whole images (one vector per ``patch``-side image, measured
    on the meta device) without the form ``fully_conv`` makes fully convolutional, so they map lone tiles only;
    else None."""
    if not layers or classifies(layers) or patch is None or patch < 1:
        return None
    net = nn.Sequential(*layers)
    weight = next((p for p in net.parameters()), torch.empty(0))
    try:
        try:
            out = meta_output_shape(net, channels, (patch, patch), weight.dtype)
        except NotImplementedError:            # an op without a meta kernel: one real forward (eval mode)
            with torch.no_grad():
                out = net(torch.zeros(1, channels, patch, patch, dtype=weight.dtype, device=weight.device)).shape
    except (RuntimeError, ValueError):         # a size the network refuses: not a classifier of this size
        return None
    return int(out[1]) if len(out) == 2 else None


class TileCells(nn.AvgPool2d):
    """The cell grid of a lone-tile classifier: an ``extent`` window every ``stride`` pixels (what the window
    geometry measures; the cells' values come from ``TileClassifier``)."""


def cell_grid(extent: int, stride: int | None, classes: int) -> FullyConvolutional:
    """A lone-tile classifier's cells: ``extent``-pixel tiles every ``stride`` pixels (default ``extent``: tiles side by
    side); ConfigError for a stride below 1."""
    stride = extent if stride is None else stride
    if stride < 1:
        raise ConfigError("--output-stride", f"must be at least 1 pixel, got {stride}")
    net = FullyConvolutional(TileCells(extent, stride=stride), nn.Softmax(dim=1)).eval()
    net.shape = network_shape(net, 3, extent, classes, torch.float32)
    return net


def refuse_dense_map(lone_tiles: bool, mode: MapMode, model: str) -> None:
    """``--map-mode dense`` of a classifier that maps lone tiles only: refused, naming ``--map-mode tiles``."""
    if lone_tiles and mode == MapMode.DENSE:
        raise ConfigError("--map-mode", f"{model} sees each tile as a whole (attention, or a head that is not a "
                                        f"global pool), so no fully convolutional map (dense) can compute its "
                                        f"cells; pass --map-mode tiles (each cell the classifier on its lone tile, "
                                        f"as trained) or auto (the default, which chooses tiles for it)")


def _chunks(count: int, size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, count, max(1, size)):
        yield start, min(start + size, count)
