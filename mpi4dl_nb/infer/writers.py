"""Outputs of slide inference: the probability array (.npy, filled window by window), a pyramidal tiled
.tif heat map that OpenSlide and slide viewers open, and a .png overlay of the heat map on the slide."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..spatial.geometry import Box

OUTPUT_KINDS = (".npy", ".tif", ".tiff", ".png")
TIFF_TILE = 256
COLORMAP = "inferno"
BACKGROUND = (255, 255, 255)   # cells not computed (background windows): white, as slide glass
Fingerprint = dict[str, object]  # JSON values a partial output must share with the run that continues it


def check_outputs(paths: list[Path], overwrite: bool) -> None:
    """Refuse unknown kinds, duplicates and (without ``overwrite``) existing files."""
    from ..config import ConfigError

    if not paths:
        raise ConfigError("--output", "give at least one output: out.npy, out.tif or out.png")
    for path in paths:
        if path.suffix.lower() not in OUTPUT_KINDS:
            raise ConfigError("--output", f"{path}: unknown kind {path.suffix!r}; use .npy (probabilities), "
                              f".tif (pyramidal heat map) or .png (overlay)")
        if path.exists() and not overwrite:
            raise ConfigError("--output", f"{path} exists; pass --overwrite to replace it, or another name")
        if not path.parent.is_dir():
            raise ConfigError("--output", f"{path}: directory {path.parent} does not exist")
    if len({p.resolve() for p in paths}) != len(paths):
        raise ConfigError("--output", "the same file is named twice")


def work_path(outputs: list[Path]) -> Path:
    """Where the probabilities accumulate during the run (and stay for ``--resume``)."""
    npy = [p for p in outputs if p.suffix.lower() == ".npy"]
    base = npy[0] if npy else outputs[0]
    return base.with_name(base.name + ".partial.npy")


def progress_path(work: Path) -> Path:
    return work.with_name(work.name + ".json")


class HeatmapStore:
    """The ``(classes, H', W')`` probability array in a .npy file, written box by box (memory-mapped)."""

    def __init__(self, path: Path, shape: tuple[int, int, int], dtype: np.dtype, *, create: bool) -> None:
        self.path = path
        if create:
            self.array = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
        else:
            self.array = np.load(path, mmap_mode="r+")
            if self.array.shape != shape or self.array.dtype != dtype:
                raise ValueError(f"{path} holds a {self.array.dtype} array of shape {self.array.shape}, "
                                 f"not {np.dtype(dtype)} {shape}")

    def write(self, box: Box, values: np.ndarray) -> None:
        r0, r1, c0, c1 = box
        self.array[:, r0:r1, c0:c1] = values

    def fill(self, box: Box, value: float = float("nan")) -> None:
        r0, r1, c0, c1 = box
        self.array[:, r0:r1, c0:c1] = value

    def flush(self) -> None:
        self.array.flush()

    def close(self) -> None:
        self.flush()
        del self.array


@dataclass(frozen=True)
class Progress:
    """A partial output's resume record: what made it, and the output rows ``[0, rows_done)`` that are final."""

    fingerprint: Fingerprint
    rows_done: int


def save_progress(path: Path, fingerprint: Fingerprint, rows_done: int) -> None:
    """Record atomically that output rows ``[0, rows_done)`` are final (temporary file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        json.dump({"fingerprint": fingerprint, "rows_done": rows_done}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def load_progress(path: Path) -> Progress | None:
    if not path.is_file():
        return None
    with open(path) as handle:
        data = json.load(handle)
    return Progress(dict(data["fingerprint"]), int(data["rows_done"]))


# ------------------------------------------------------------------ images
def colormap_lut(name: str = COLORMAP) -> np.ndarray:
    """256 x 3 uint8 colours of a matplotlib colormap."""
    import matplotlib

    return (matplotlib.colormaps[name](np.linspace(0, 1, 256))[:, :3] * 255).round().astype(np.uint8)


def colorize(values: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """Probabilities (any shape) -> RGB uint8; NaN (not computed) -> background white."""
    finite = np.isfinite(values)
    index = np.clip(np.nan_to_num(values, nan=0.0) * 255.0 + 0.5, 0, 255).astype(np.uint8)
    rgb = lut[index]
    rgb[~finite] = BACKGROUND
    return rgb


def halve(plane: np.ndarray) -> np.ndarray:
    """2 x 2 mean (NaN-aware) of a 2-D float array; odd edges keep their last row/column alone."""
    h, w = plane.shape
    padded = np.full((h + h % 2, w + w % 2), np.nan, dtype=np.float32)
    padded[:h, :w] = plane
    return nan_mean(padded.reshape(padded.shape[0] // 2, 2, padded.shape[1] // 2, 2), (1, 3))


def nan_mean(blocks: np.ndarray, axis: tuple[int, ...]) -> np.ndarray:
    """Mean ignoring NaN; NaN where a block holds nothing else (quietly)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=RuntimeWarning)
        return np.nanmean(blocks, axis=axis).astype(np.float32)


def pyramid_levels(height: int, width: int, tile: int = TIFF_TILE) -> list[tuple[int, int]]:
    """(height, width) of every level: halving until the whole level fits one tile."""
    levels = [(height, width)]
    while max(levels[-1]) > tile:
        h, w = levels[-1]
        levels.append(((h + 1) // 2, (w + 1) // 2))
    return levels


def _strip_rows(plane: np.ndarray, rows: int) -> Iterator[tuple[int, np.ndarray]]:
    for r0 in range(0, plane.shape[0], rows):
        yield r0, np.asarray(plane[r0:r0 + rows], dtype=np.float32)


def write_tiff(path: Path, plane: np.ndarray, *, description: Mapping[str, object], tile: int = TIFF_TILE) -> None:
    """A pyramidal tiled RGB TIFF of one probability plane (H' x W', memory-mapped is fine).

    Level 0 has one pixel per output cell; each further level halves it (2 x 2 means), each
    level its own page as OpenSlide's generic TIFF reader expects. Colours: ``COLORMAP``;
    cells not computed are white. The level's data are built strip by strip: memory stays at
    a few tile rows whatever the slide size.
    """
    import tifffile

    lut = colormap_lut()
    scratch: list[Path] = []
    try:
        current: np.ndarray = plane
        with tifffile.TiffWriter(path, bigtiff=plane.size * 3 > 2**31) as tw:
            for index, (height, width) in enumerate(pyramid_levels(plane.shape[0], plane.shape[1], tile)):
                tw.write(_tiles(current, tile, lut), shape=(height, width, 3), dtype=np.uint8,
                         tile=(tile, tile), photometric="rgb", compression="zlib",
                         subfiletype=1 if index else 0, metadata=None,
                         description=json.dumps(description) if index == 0 else None)
                if max(height, width) > tile:
                    nxt = path.with_name(f".{path.name}.level{index + 1}.npy")
                    scratch.append(nxt)
                    current = _halved_copy(current, nxt, tile)
    finally:
        for file in scratch:
            file.unlink(missing_ok=True)


def _halved_copy(plane: np.ndarray, path: Path, tile: int) -> np.ndarray:
    height, width = plane.shape
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=((height + 1) // 2, (width + 1) // 2))
    for r0, strip in _strip_rows(plane, 2 * tile):
        out[r0 // 2:r0 // 2 + (strip.shape[0] + 1) // 2] = halve(strip)
    out.flush()
    return out


def _tiles(plane: np.ndarray, tile: int, lut: np.ndarray) -> Iterator[np.ndarray]:
    for _, strip in _strip_rows(plane, tile):
        rgb = colorize(strip, lut)
        for c0 in range(0, plane.shape[1], tile):
            yield np.ascontiguousarray(rgb[:, c0:c0 + tile])


def write_overlay(path: Path, thumbnail: np.ndarray, plane: np.ndarray, *, stride: int, offset: float,
                  slide_size: tuple[int, int], opacity: float = 0.5) -> None:
    """A PNG of the slide overview with the heat map laid over it (cells placed at their fields' centres).

    ``slide_size`` (height, width) of the level the overview shows; cell ``(i, j)`` is drawn
    over pixels ``[i*stride, (i+1)*stride) + offset`` of it.
    """
    from PIL import Image

    th, tw = thumbnail.shape[:2]
    scale = tw / slide_size[1]
    block = max(1, int(1.0 / max(stride * scale, 1e-9)))
    small = _block_mean(plane, block)
    rgb = colorize(small, colormap_lut())
    alpha = np.where(np.isfinite(small), int(round(255 * opacity)), 0).astype(np.uint8)
    heat = Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
    size = (max(1, round(plane.shape[1] * stride * scale)), max(1, round(plane.shape[0] * stride * scale)))
    heat = heat.resize(size, Image.Resampling.NEAREST if stride * scale >= 2 else Image.Resampling.BILINEAR)
    base = Image.fromarray(np.ascontiguousarray(thumbnail[:, :, :3])).convert("RGBA")
    layer = Image.new("RGBA", base.size, (0, 0, 0, 0))
    layer.paste(heat, (int(round(offset * scale)), int(round(offset * scale))))
    Image.alpha_composite(base, layer).convert("RGB").save(path)


def _block_mean(plane: np.ndarray, block: int) -> np.ndarray:
    """Mean over ``block x block`` cells (NaN-aware), read strip by strip."""
    if block == 1:
        return np.asarray(plane, dtype=np.float32)
    height, width = plane.shape
    rows = []
    for _, strip in _strip_rows(plane, block):
        padded = np.full((block, -(-width // block) * block), np.nan, dtype=np.float32)
        padded[:strip.shape[0], :width] = strip
        rows.append(nan_mean(padded.reshape(block, -1, block), (0, 2)))
    return np.stack(rows)
