"""Resolution in microns per pixel (MPP): read from slides and images, the pyramid level and resampling for a target.

A slide's level 0 carries its MPP in OpenSlide's ``openslide.mpp-x``/``-y`` properties (scanner
formats, and TIFF resolution tags for generic TIFFs); a plain image in its TIFF resolution tags or
its PNG/JPEG density. ``choose_level`` picks the coarsest pyramid level at least as fine as a
target MPP, and ``AreaResampler`` shrinks it the rest of the way: each target pixel is the mean of
the level pixels it covers (a box filter, weighted by overlap). Its weights depend only on global
pixel coordinates and are summed in a fixed order, so any box of the resampled image read alone is
bitwise equal to the same box of the whole image resampled at once: tiles and windows read by
different ranks stay exact.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..schema import flag

MAGNIFICATION_MPP = 10.0      # µm/px at 1x objective magnification: 40x = 0.25, 20x = 0.5, 10x = 1.0
LEVEL_TOLERANCE = 0.02        # a level within 2 % of the target is used as it is (no resampling)
PLAUSIBLE_MPP = (0.01, 20.0)  # outside this a resolution tag is a screen default (72 dpi), not a microscope's
MICRONS_PER = {"INCH": 25400.0, "CENTIMETER": 10000.0, "MILLIMETER": 1000.0}
Box = tuple[int, int, int, int]   # r0, r1, c0, c1


def plausible(mpp: float | None) -> float | None:
    """``mpp`` when it is a microscope's resolution, else None (unset, or a screen default such as 72 dpi)."""
    if mpp is None or not math.isfinite(mpp) or not PLAUSIBLE_MPP[0] <= mpp <= PLAUSIBLE_MPP[1]:
        return None
    return float(mpp)


def isotropic(x: float | None, y: float | None, where: str) -> float | None:
    """One MPP from the x and y ones; ValueError when pixels are not square."""
    if x is None or y is None:
        return plausible(x if y is None else y)
    if abs(x / y - 1.0) > LEVEL_TOLERANCE:
        raise ValueError(f"{where}: pixels are not square ({x:g} x {y:g} µm); resample it to square pixels first")
    return plausible((x + y) / 2.0)


def properties_mpp(properties: Mapping[str, str], where: str) -> float | None:
    """Level 0's MPP from OpenSlide properties (``openslide.mpp-x``/``-y``); None when absent."""
    def number(key: str) -> float | None:
        try:
            return float(properties[key])
        except (KeyError, ValueError):
            return None

    return isotropic(number("openslide.mpp-x"), number("openslide.mpp-y"), where)


def image_mpp(path: str | Path) -> float | None:
    """An image file's MPP: TIFF resolution tags, or the PNG/JPEG density; None when it carries none."""
    path = Path(path)
    if path.suffix.lower() in (".tif", ".tiff"):
        import tifffile

        try:
            with tifffile.TiffFile(path) as tif:
                tags = tif.pages.first.tags
                unit = tags.get("ResolutionUnit")
                per = MICRONS_PER.get(getattr(unit.value, "name", "") if unit is not None else "INCH")

                def tag(name: str) -> float | None:
                    value = tags.get(name)
                    if value is None or per is None:
                        return None
                    num, den = value.value
                    return per * den / num if num else None

                return isotropic(tag("XResolution"), tag("YResolution"), str(path))
        except (OSError, ValueError, tifffile.TiffFileError):
            return None
    from PIL import Image

    try:
        with Image.open(path) as image:
            dpi = image.info.get("dpi")
    except OSError:
        return None
    if not dpi:
        return None
    return isotropic(25400.0 / float(dpi[0]) if dpi[0] else None, 25400.0 / float(dpi[1]) if dpi[1] else None,
                     str(path))


def target_mpp(mpp: float | None, magnification: float | None) -> float | None:
    """The resolution asked for: ``--mpp``, or ``--magnification`` as ``MAGNIFICATION_MPP / M``; checked."""
    if mpp is not None and magnification is not None:
        raise ConfigError("--mpp", "give --mpp or --magnification, not both")
    if magnification is not None:
        if not magnification > 0:
            raise ConfigError("--magnification", f"must be > 0, got {magnification}")
        return MAGNIFICATION_MPP / magnification
    if mpp is not None and not mpp > 0:
        raise ConfigError("--mpp", f"must be > 0 (µm per pixel), got {mpp}")
    return mpp



@dataclass(frozen=True)
class ResolutionChoice:
    """The resolution a command works at and a slide's own (``--mpp`` or ``--magnification``, ``--source-mpp``;
    train, evaluate, infer): checked on construction."""

    mpp: float | None = flag("--mpp", "µm per pixel to work at: the slide level at or finer than it, resampled to "
                                      "it (train: recorded as infer's default; infer/evaluate: default the "
                                      "checkpoint's)", None, parse=float, group="resolution")
    magnification: float | None = flag("--magnification", "instead of --mpp: objective magnification, as 10 / M "
                                                          "µm per pixel (40x = 0.25)", None, parse=float,
                                       group="resolution")
    source_mpp: float | None = flag("--source-mpp", "level 0's µm per pixel, for slides that carry none (or to "
                                                    "correct them)", None, parse=float, group="resolution")

    def __post_init__(self) -> None:
        target_mpp(self.mpp, self.magnification)
        if self.source_mpp is not None and not self.source_mpp > 0:
            raise ConfigError("--source-mpp", f"must be > 0 (µm per pixel), got {self.source_mpp}")

    @property
    def target(self) -> float | None:
        """The µm per pixel asked for (``--mpp``, or ``--magnification`` converted), None: as stored."""
        return target_mpp(self.mpp, self.magnification)

    @property
    def given(self) -> str | None:
        """The first resolution flag given (None: none)."""
        return next((knob for knob, value in (("--mpp", self.mpp), ("--magnification", self.magnification),
                                              ("--source-mpp", self.source_mpp)) if value is not None), None)

@dataclass(frozen=True)
class LevelChoice:
    """How to read a slide at a resolution: pyramid ``level``, then shrink by ``scale`` (1.0: as it is)."""

    level: int
    scale: float
    mpp: float | None       # µm per pixel of what is read (None: unknown)

    @property
    def resampled(self) -> bool:
        return self.scale != 1.0

    def extent(self, level_size: tuple[int, int]) -> tuple[int, int]:
        """(width, height) read of a level of ``level_size`` (width, height): shrunk by ``scale``."""
        if not self.resampled:
            return level_size
        resampler = AreaResampler(self.scale)
        return resampler.extent(level_size[0]), resampler.extent(level_size[1])


def choose_level(base_mpp: float, downsamples: Sequence[float], target: float, where: str) -> LevelChoice:
    """The coarsest level at most ``target`` µm/px (within ``LEVEL_TOLERANCE``), and the shrink left to do."""
    if target < base_mpp * (1.0 - LEVEL_TOLERANCE):
        raise ConfigError("--mpp", f"{where} is scanned at {base_mpp:g} µm/px at its finest; {target:g} µm/px "
                                   f"would invent detail: use --mpp >= {base_mpp:g} (or train at a coarser --mpp)")
    level = 0
    for index, down in enumerate(downsamples):
        if base_mpp * down <= target * (1.0 + LEVEL_TOLERANCE):
            level = index
    level_mpp = base_mpp * downsamples[level]
    scale = target / level_mpp
    if abs(scale - 1.0) <= LEVEL_TOLERANCE:
        return LevelChoice(level, 1.0, level_mpp)
    return LevelChoice(level, scale, target)


def level_mpp(base_mpp: float | None, downsamples: Sequence[float], level: int) -> float | None:
    """µm per pixel of ``level`` (None when level 0's is unknown)."""
    return None if base_mpp is None else base_mpp * float(downsamples[level])


@dataclass(frozen=True)
class AreaResampler:
    """Shrink by ``scale`` (> 1): target pixel ``i`` is the overlap-weighted mean of source ``[i*s, (i+1)*s)``."""

    scale: float

    def __post_init__(self) -> None:
        if not self.scale >= 1.0:
            raise ValueError(f"AreaResampler shrinks only: scale {self.scale} < 1")

    def extent(self, source: int) -> int:
        """Target pixels whose footprint lies inside ``source`` pixels."""
        return int(math.floor(source / self.scale + 1e-9))

    def source_range(self, start: int, stop: int) -> tuple[int, int]:
        """Source pixels target pixels ``[start, stop)`` read."""
        return int(math.floor(start * self.scale)), int(math.ceil(stop * self.scale - 1e-9))

    def taps(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Per target pixel of ``[start, stop)``: the source indices it reads and their weights (fixed tap count)."""
        count = int(math.ceil(self.scale)) + 1
        index = np.arange(start, stop, dtype=np.float64)
        low, high = index * self.scale, (index + 1) * self.scale
        first = np.floor(low).astype(np.int64)
        source = first[:, None] + np.arange(count)[None, :]
        overlap = np.minimum(high[:, None], source + 1.0) - np.maximum(low[:, None], source.astype(np.float64))
        return source, np.clip(overlap, 0.0, None) / self.scale

    def source_box(self, box: Box) -> Box:
        """The source pixels ``box`` (target pixels) reads, with the taps' padding (past the source: zeros)."""
        r0, r1, c0, c1 = box
        y0, y1 = self.source_range(r0, r1)
        x0, x1 = self.source_range(c0, c1)
        pad = int(math.ceil(self.scale)) + 1
        return y0, y1 + pad, x0, x1 + pad

    def mean(self, source: np.ndarray, box: Box) -> np.ndarray:
        """float64 ``(h, w, C)``: each target pixel of ``box`` the overlap-weighted mean of ``source`` (float64
        ``(H, W, C)``, the pixels of ``source_box(box)``), columns first, taps in a fixed order."""
        r0, r1, c0, c1 = box
        y0, _, x0, _ = self.source_box(box)
        rows, row_w = self.taps(r0, r1)
        cols, col_w = self.taps(c0, c1)
        across = np.zeros((source.shape[0], c1 - c0, source.shape[2]), dtype=np.float64)
        for t in range(cols.shape[1]):
            across += col_w[:, t, None] * source[:, cols[:, t] - x0]
        out = np.zeros((r1 - r0, c1 - c0, source.shape[2]), dtype=np.float64)
        for t in range(rows.shape[1]):
            out += row_w[:, t, None, None] * across[rows[:, t] - y0]
        return out

    def read(self, read_source: Callable[[Box], np.ndarray], box: Box) -> np.ndarray:
        """``box`` (target pixels) of the resampled image, uint8 H x W x C, from ``read_source(source box)``."""
        source = read_source(self.source_box(box)).astype(np.float64)
        return np.clip(np.rint(self.mean(source, box)), 0, 255).astype(np.uint8)

    def vote(self, read_source: Callable[[Box], np.ndarray], box: Box) -> np.ndarray:
        """``box`` (target pixels) of a resampled label map, int64 ``(h, w)``, from ``read_source(source box)``
        (integer ``(H, W)``): each target pixel the label covering most of its footprint (overlap-weighted, as
        ``read`` weighs; a tie goes to the smaller label). Labels are chosen, never interpolated."""
        labels = np.asarray(read_source(self.source_box(box)))
        r0, r1, c0, c1 = box
        best = np.full((r1 - r0, c1 - c0), -1.0)
        chosen = np.zeros((r1 - r0, c1 - c0), dtype=np.int64)
        for value in np.unique(labels):              # ascending: a later label must cover strictly more
            share = self.mean((labels == value).astype(np.float64)[:, :, None], box)[:, :, 0]
            more = share > best
            chosen[more], best[more] = int(value), share[more]
        return chosen


def missing_mpp(where: str) -> ConfigError:
    """The refusal for a source without a resolution when one is needed."""
    return ConfigError("--source-mpp", f"{where} carries no resolution (no MPP property or resolution tag); pass "
                                       f"--source-mpp with its level-0 µm per pixel (e.g. 0.25 at 40x, 0.5 at 20x)")


def resolve_read(base_mpp: float | None, downsamples: Sequence[float], where: str, *, target: float | None,
                 level: int | None, trained_at: float | None = None) -> LevelChoice:
    """How to read ``where``: ``--slide-level`` as it is, or the level and shrink for ``target`` µm/px.

    ``target`` is ``--mpp`` (or ``--magnification``), ``trained_at`` the checkpoint's training MPP (the
    default target); ``base_mpp`` level 0's (the file's, or ``--source-mpp``). Refused: both a level and
    ``--mpp``; a resolution needed but unknown; a level whose resolution differs from the training's.
    """
    if level is not None and target is not None:
        raise ConfigError("--slide-level", "give --slide-level or --mpp/--magnification, not both")
    if level is not None:
        mpp = level_mpp(base_mpp, downsamples, level)
        if trained_at is not None and mpp is not None and abs(mpp / trained_at - 1.0) > LEVEL_TOLERANCE:
            raise ConfigError("--slide-level", f"level {level} of {where} is {mpp:g} µm/px but the checkpoint "
                                               f"trained at {trained_at:g} µm/px; drop --slide-level (the level is "
                                               f"chosen by resolution), or pass --mpp to run at another one on purpose")
        return LevelChoice(level, 1.0, mpp)
    wanted = target if target is not None else trained_at
    if wanted is None:
        return LevelChoice(0, 1.0, base_mpp)
    if base_mpp is None:
        raise missing_mpp(where)
    return choose_level(base_mpp, downsamples, wanted, where)


def slide_choice(slide: object, path: Path, level: int, target: float | None,
                 source_mpp: float | None) -> LevelChoice:
    """Training's read of a slide: ``--slide-level`` as it is, or the level and shrink for ``--mpp`` (the MPP:
    OpenSlide's properties; a plain TIFF's resolution tags)."""
    if target is not None and level != 0:
        raise ConfigError("--slide-level", "give --slide-level or --mpp/--magnification, not both")
    properties = getattr(slide, "properties", {})
    base = source_mpp if source_mpp is not None else properties_mpp(properties, str(path))
    if base is None and source_mpp is None and not properties:      # a plain image read whole: its own tags
        base = image_mpp(path)
    downsamples = [float(d) for d in getattr(slide, "level_downsamples", [1.0])]
    return resolve_read(base, downsamples, str(path), target=target, level=None if target is not None else level)


def image_choice(path: Path, target: float | None, source_mpp: float | None) -> LevelChoice:
    """How to read an image file (one level) at ``target`` µm/px: its own MPP, or ``--source-mpp``, and the shrink
    left to do; refused when a target is set and the image carries no MPP (naming ``--source-mpp``)."""
    base = source_mpp if source_mpp is not None else image_mpp(path)
    return resolve_read(base, (1.0,), str(path), target=target, level=None)


def common_mpp(values: Iterable[float | None]) -> float | None:
    """The one MPP of several sources (None when any is unknown or they differ beyond ``LEVEL_TOLERANCE``)."""
    found = list(values)
    if not found or any(v is None for v in found):
        return None
    known = [v for v in found if v is not None]
    return known[0] if max(known) <= min(known) * (1.0 + LEVEL_TOLERANCE) else None


def dataset_mpp(dataset: object) -> float | None:
    """The µm per pixel a dataset's images are read at (None: unknown)."""
    mpp = getattr(dataset, "mpp", None)
    return float(mpp) if isinstance(mpp, (int, float)) else None
