"""The slide-aligned map as a pyramid (level 0 read from the probability array, coarser levels as 2 x 2 means in
scratch files), and pyramidal tiled TIFFs of it that OpenSlide, QuPath and slide viewers open, with their MPP.

Everything moves tile by tile: a level is made from 2 x 2 tiles of the one below and a TIFF
page is encoded one tile at a time, so memory holds a few tiles whatever the slide's size.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from .colors import colorize, colormap_lut
from .kinds import OutputKind
from .placement import CellPlacement

TIFF_TILE = 256
NO_LABEL = 255          # a label map's pixels without data
Tick = Callable[[], None]


def pyramid_levels(height: int, width: int, tile: int = TIFF_TILE) -> list[tuple[int, int]]:
    """(height, width) of every level: halving until the whole level fits one tile."""
    levels = [(height, width)]
    while max(levels[-1]) > tile:
        h, w = levels[-1]
        levels.append(((h + 1) // 2, (w + 1) // 2))
    return levels


def halve(block: np.ndarray) -> np.ndarray:
    """2 x 2 means (NaN-aware) over the last two axes; an odd edge keeps its last row/column alone."""
    *lead, h, w = block.shape
    padded = np.full((*lead, h + h % 2, w + w % 2), np.nan, dtype=np.float32)
    padded[..., :h, :w] = block
    grouped = padded.reshape(*lead, padded.shape[-2] // 2, 2, padded.shape[-1] // 2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=RuntimeWarning)   # all-NaN blocks stay NaN, quietly
        return np.nanmean(grouped, axis=(-3, -1)).astype(np.float32)


class MapPyramid:
    """The map of ``probs`` (classes, H', W') placed on the slide (``placement``), level by level."""

    def __init__(self, probs: np.ndarray, placement: CellPlacement, scratch: Path, *, tile: int = TIFF_TILE,
                 tick: Tick = lambda: None) -> None:
        self.probs, self.placement, self.tile, self.tick = probs, placement, tile, tick
        self.classes = int(probs.shape[0])
        self.levels = pyramid_levels(*placement.map_shape, tile)
        self.scratch = scratch
        self._made: list[np.ndarray] = []
        self._files: list[Path] = []

    def block(self, level: int, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        """Rows ``[r0, r1)`` and columns ``[c0, c1)`` of ``level``: float32 (classes, h, w), NaN without data."""
        if level == 0:
            out = np.full((self.classes, r1 - r0, c1 - c0), np.nan, dtype=np.float32)
            (a0, a1), (b0, b1) = self.placement.cells_of_map(r0, r1, 0), self.placement.cells_of_map(c0, c1, 1)
            if a0 < a1 and b0 < b1:
                shift = self.placement.shift
                out[:, a0 + shift - r0:a1 + shift - r0, b0 + shift - c0:b1 + shift - c0] = self.probs[:, a0:a1, b0:b1]
            return out
        return np.asarray(self._level(level)[:, r0:r1, c0:c1], dtype=np.float32)

    def tiles(self, level: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """(row, column, block) of every tile of ``level``, row by row."""
        height, width = self.levels[level]
        for r0 in range(0, height, self.tile):
            for c0 in range(0, width, self.tile):
                yield r0, c0, self.block(level, r0, min(r0 + self.tile, height), c0, min(c0 + self.tile, width))
                self.tick()

    def _level(self, level: int) -> np.ndarray:
        while len(self._made) < level:
            below = len(self._made)            # make level below + 1 from level below
            height, width = self.levels[below + 1]
            file = self.scratch.with_name(f".{self.scratch.name}.level{below + 1}.npy")
            self._files.append(file)
            made = np.lib.format.open_memmap(file, mode="w+", dtype=np.float32, shape=(self.classes, height, width))
            for r0, c0, block in self._pairs(below):
                part = halve(block)
                made[:, r0:r0 + part.shape[1], c0:c0 + part.shape[2]] = part
            made.flush()
            self._made.append(made)
        return self._made[level - 1]

    def _pairs(self, level: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """Blocks of ``level`` two tiles a side, with the tile they halve into on the level above."""
        height, width = self.levels[level]
        step = 2 * self.tile
        for r0 in range(0, height, step):
            for c0 in range(0, width, step):
                yield r0 // 2, c0 // 2, self.block(level, r0, min(r0 + step, height), c0, min(c0 + step, width))
                self.tick()

    def close(self) -> None:
        """Remove the scratch files."""
        self._made.clear()
        for file in self._files:
            file.unlink(missing_ok=True)


def encode(block: np.ndarray, kind: OutputKind, heat_class: int, lut: np.ndarray | None) -> np.ndarray:
    """A map block (classes, h, w) as the pixels of a ``kind`` TIFF."""
    if kind is OutputKind.PROBABILITIES:
        values = np.clip(np.rint(np.nan_to_num(block, nan=0.0) * 255.0), 0, 255).astype(np.uint8)
        return np.ascontiguousarray(np.moveaxis(values, 0, -1) if values.shape[0] > 1 else values[0])
    if kind is OutputKind.LABELS:
        known = np.isfinite(block).all(axis=0)
        labels = np.argmax(np.nan_to_num(block, nan=-1.0), axis=0).astype(np.uint8)
        labels[~known] = NO_LABEL
        return labels
    assert lut is not None
    return colorize(block[heat_class], lut)


def write_map_tiff(path: Path, pyramid: MapPyramid, kind: OutputKind, *, heat_class: int,
                   description: Mapping[str, object], class_names: Sequence[str]) -> None:
    """A pyramidal tiled TIFF of the map: one page per level (as OpenSlide reads pyramids), resolution tags in
    µm per pixel when the slide's MPP is known, and ``description`` (JSON) in level 0's ImageDescription."""
    import tifffile

    classes = pyramid.classes
    samples = {OutputKind.PROBABILITIES: classes, OutputKind.LABELS: 1, OutputKind.PREVIEW: 3}[kind]
    lut = colormap_lut() if kind is OutputKind.PREVIEW else None
    meta = {**description, "kind": str(kind), "classes": list(class_names),
            **({"heat_class": class_names[heat_class]} if kind is OutputKind.PREVIEW else {}),
            **({"no_data": NO_LABEL} if kind is OutputKind.LABELS else {})}
    mpp = pyramid.placement.map_mpp
    height0, width0 = pyramid.levels[0]
    with tifffile.TiffWriter(path, bigtiff=height0 * width0 * samples > 2**31) as tw:
        for level, (height, width) in enumerate(pyramid.levels):
            shape = (height, width, samples) if samples > 1 else (height, width)
            pixel = None if mpp is None else mpp * width0 / width      # µm per pixel of this level
            extra = ["unspecified"] * (samples - 1) if kind is OutputKind.PROBABILITIES and samples > 1 else None
            tiles = (encode(block, kind, heat_class, lut) for _, _, block in pyramid.tiles(level))
            tw.write(tiles, shape=shape, dtype=np.uint8, tile=(pyramid.tile, pyramid.tile),
                     photometric="rgb" if kind is OutputKind.PREVIEW else "minisblack", compression="zlib",
                     subfiletype=1 if level else 0, metadata=None, extrasamples=extra,
                     resolution=None if pixel is None else (1e4 / pixel, 1e4 / pixel),
                     resolutionunit=None if pixel is None else "CENTIMETER",
                     description=json.dumps(meta) if level == 0 else None)
