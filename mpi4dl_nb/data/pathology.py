"""Pathology data: a folder of image tiles, or whole-slide images cut into tiles read region by region via OpenSlide."""
from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from .bounds import SlideBounds, slide_bounds
from .crops import NATIVE, CentreCrop
from .dataset import Box, check_box, to_tensor
from .files import SLIDE_ONLY_EXTENSIONS, TILE_EXTENSIONS, class_of, folder_files, require_path
from .resolution import LevelChoice
from .stain_reads import OVERVIEW_SIDE, StainedReads
from .tissue_mask import TissueMethod, tissue_mask

if TYPE_CHECKING:
    from PIL import Image

PLAIN_TIFF_PIXELS = 1 << 26     # a plain (not pyramidal) TIFF read whole as a slide: 8192 x 8192 pixels, 67 megapixels


class Slide(Protocol):
    """What the data and inference code use of an ``openslide.OpenSlide`` (or ``ImageSlide``)."""

    @property
    def level_count(self) -> int: ...

    @property
    def level_dimensions(self) -> Sequence[tuple[int, int]]: ...

    @property
    def level_downsamples(self) -> Sequence[float]: ...

    def read_region(self, location: tuple[int, int], level: int, size: tuple[int, int]) -> Image.Image: ...

    def get_thumbnail(self, size: tuple[int, int]) -> Image.Image: ...

    def close(self) -> None: ...


def bounds_of(slide: Slide) -> SlideBounds:
    """QuPath's image of ``slide``: OpenSlide's bounds when it reports them, else the whole level-0 frame."""
    return slide_bounds(getattr(slide, "properties", {}), slide.level_dimensions[0])


def read_extent(slide: Slide, choice: LevelChoice) -> tuple[int, int]:
    """(width, height) of ``slide`` at the resolution ``choice`` reads, within its bounds (QuPath's image)."""
    level = choice.level
    return choice.extent(bounds_of(slide).level_size(float(slide.level_downsamples[level]),
                                                     slide.level_dimensions[level]))


def coarse_tissue(slide: Slide, method: TissueMethod = TissueMethod.SATURATION) -> np.ndarray:
    """The tissue mask of ``slide``'s coarsest level (a boolean image of the whole slide, within its bounds; ``method``:
    what counts as tissue, an Otsu threshold computed on this overview)."""
    coarse = slide.level_count - 1
    bounds = bounds_of(slide)
    width, height = bounds.level_size(float(slide.level_downsamples[coarse]), slide.level_dimensions[coarse])
    return tissue_mask(rgba_to_rgb(slide.read_region((bounds.x, bounds.y), coarse, (width, height))), method)


def rgba_to_rgb(image: Image.Image | np.ndarray) -> np.ndarray:
    """OpenSlide's RGBA region composited on white (transparent = outside the scanned area)."""
    pixels = np.asarray(image, dtype=np.float32)
    alpha = pixels[:, :, 3:4] / 255.0
    return np.round(pixels[:, :, :3] * alpha + 255.0 * (1.0 - alpha)).astype(np.uint8)


class TileFolderDataset(StainedReads):
    """Image tiles in ``root`` (or ``root/<class>/``); each is centre-cropped to ``image_size`` (``crop_note``
    says so for those larger).

    ``files`` (default: every tile below ``root``) gives the tiles to use, e.g. without bad ones. ``mpp``
    (``--mpp``): each tile is first shrunk from its own MPP (resolution tags, or ``source_mpp``) to it
    (``data/crops.py``; refused for a tile without MPP, or too small then). ``self.mpp``: the resolution
    read at (None: unknown or mixed)."""

    def __init__(self, root: str | Path, image_size: int, *, num_classes: int | None = None,
                 files: Sequence[Path] | None = None, classes: Sequence[str] | None = None,
                 mpp: float | None = None, source_mpp: float | None = None) -> None:
        from .resolution import image_choice

        self.root = require_path(root)
        self.image_size = image_size
        self.channels = 3
        self.files = sorted(files) if files is not None else sorted(
            p for p in self.root.rglob("*") if p.is_file() and p.suffix.lower() in TILE_EXTENSIONS)
        if not self.files:
            raise FileNotFoundError(f"--datapath {str(root)!r} holds no image tiles "
                                    f"({', '.join(TILE_EXTENSIONS)})")
        self.labels, self.classes = class_of(self.files, self.root, classes)
        self.num_classes = check_classes(len(self.classes), num_classes, root)
        self.source_mpp = source_mpp
        # per tile, the shrink to --mpp (None: every tile as it is)
        self.choices = None if mpp is None else [image_choice(p, mpp, source_mpp) for p in self.files]
        if self.choices is not None:
            self._check_sizes()

    @functools.cached_property
    def mpp(self) -> float | None:
        """µm per pixel the tiles are read at (None: unknown, or they differ); reads tiles' headers once."""
        from .crops import folder_mpp
        from .resolution import common_mpp

        return folder_mpp(self.files, self.source_mpp) if self.choices is None else common_mpp(
            c.mpp for c in self.choices)

    def crop(self, index: int, width: int, height: int) -> CentreCrop:
        """How tile ``index`` (``width x height`` pixels) is read: its centre crop at the run's resolution."""
        return CentreCrop(width, height, self.image_size, NATIVE if self.choices is None else self.choices[index])

    @contextmanager
    def _tile(self, index: int) -> Iterator[tuple[Image.Image, CentreCrop]]:
        """Tile ``index`` open, with its crop; ValueError when it cannot be read or is too small at the resolution."""
        from PIL import Image

        path = self.files[index]
        try:
            with Image.open(path) as img:
                crop = self.crop(index, *img.size)
                if (problem := crop.problem()) is not None:
                    raise ValueError(f"tile {path} {problem}")
                yield img, crop
        except OSError as err:
            raise ValueError(f"cannot read tile {path}: {err}") from err

    def crop_note(self) -> str | None:
        """The line naming the tiles larger than ``image_size``, centre-cropped (None: none is); reads headers."""
        from PIL import Image

        def extent(index: int) -> tuple[int, int]:
            with Image.open(self.files[index]) as img:
                return self.crop(index, *img.size).extent
        larger = [size for size in map(extent, range(len(self.files))) if max(size) > self.image_size]
        width, height = max(larger, key=lambda size: size[0] * size[1], default=(0, 0))
        return None if not larger else (
            f"{len(larger)} of {len(self.files)} tiles are larger than --image-size {self.image_size} (up to "
            f"{width}x{height}): each is centre-cropped to it, the rest unseen; to train on all of such an image, "
            f"make it a slide (a pyramidal TIFF, or a TIFF at least twice --image-size: tiled)")

    def _check_sizes(self) -> None:
        """ValueError naming the first tile too small for ``image_size`` at the run's resolution (before work)."""
        for index in range(len(self.files)):
            with self._tile(index):
                pass

    def __len__(self) -> int:
        return len(self.files)

    def label(self, index: int) -> int:
        return self.labels[index]

    def read_pixels(self, index: int, box: Box | None = None) -> torch.Tensor:
        with self._tile(index) as (img, crop):
            rgb = img.convert("RGB")
            return to_tensor(crop.pixels(lambda b: np.asarray(rgb.crop((b[2], b[0], b[3], b[1]))), box))


def check_classes(found: int, requested: int | None, where: str | Path) -> int:
    """Number of classes: ``found``; ``requested`` must equal it when the data has class folders (two or more)."""
    if requested is None:
        return max(found, 1)
    if requested < found or (found > 1 and requested != found):
        raise ValueError(f"--datapath {str(where)!r} has {found} classes but --num-classes is "
                         f"{requested}; use --num-classes {found}")
    return requested


def resolved_pixels(slide: Slide, choice: LevelChoice, box: Box) -> np.ndarray:
    """RGB pixels of ``box`` (r0, r1, c0, c1) at the resolution ``choice`` reads ``slide`` at: its level's pixels
    (one ``read_region``), shrunk to ``--mpp`` when it lies between two levels (exact box by box)."""
    level = choice.level
    downsample = float(slide.level_downsamples[level])
    bounds = bounds_of(slide)      # boxes are in QuPath's image: offset by the bounds' origin

    def level_pixels(part: Box) -> np.ndarray:
        r0, r1, c0, c1 = part
        location = (bounds.x + int(round(c0 * downsample)), bounds.y + int(round(r0 * downsample)))
        return rgba_to_rgb(slide.read_region(location, level, (c1 - c0, r1 - r0)))

    if choice.resampled:
        from .resolution import AreaResampler

        return AreaResampler(choice.scale).read(level_pixels, box)
    return level_pixels(box)


def open_slide(path: Path) -> Slide:
    """An ``openslide.OpenSlide`` for ``path``; a TIFF OpenSlide does not open (not pyramidal) read whole through
    Pillow (``openslide.ImageSlide``: one level) up to ``PLAIN_TIFF_PIXELS``; else ValueError saying why and how to
    convert it."""
    import openslide
    from PIL import Image

    try:
        return openslide.OpenSlide(str(path))
    except (openslide.OpenSlideError, openslide.OpenSlideUnsupportedFormatError, OSError) as err:
        problem: object = err or type(err).__name__
        if path.suffix.lower() in (".tif", ".tiff"):
            try:
                with Image.open(path) as image:
                    width, height = image.size
                if width * height <= PLAIN_TIFF_PIXELS:
                    return openslide.ImageSlide(str(path))
                problem = (f"a plain TIFF, not pyramidal, of {width}x{height} px, read whole only up to "
                           f"{PLAIN_TIFF_PIXELS / 1e6:.0f} megapixels")
            except (OSError, ValueError) as failed:
                problem = f"a TIFF that is not pyramidal and that Pillow cannot read either ({failed})"
            raise ValueError(f"cannot read slide {path}: {problem}; convert it to a pyramidal TIFF (vips tiffsave "
                             f"{path.name} out.tif --tile --pyramid)") from err
        raise ValueError(f"cannot read slide {path}: {problem}; OpenSlide reads pyramidal "
                         f".tif/.svs/.ndpi/.mrxs/.scn/... files") from err


@dataclass(frozen=True)
class SlideTile:
    """One tile: slide number and its top-left corner in pixels of the chosen level."""

    slide: int
    x: int
    y: int


def slide_overview(slide: Slide) -> np.ndarray:
    """A slide's RGB thumbnail (H, W, 3) uint8 at most ``OVERVIEW_SIDE`` wide or high: what its stain is estimated
    from, in training and in inference alike."""
    return np.asarray(slide.get_thumbnail((OVERVIEW_SIDE, OVERVIEW_SIDE)).convert("RGB"))


class SlideDataset(StainedReads):
    """Whole-slide images cut into ``image_size`` tiles at pyramid ``level``, keeping tiles with tissue.

    ``read(i, box)`` asks OpenSlide for exactly ``box`` of tile ``i`` (one ``read_region`` call),
    so a spatial rank touches only its own part of the slide. The tissue filter looks at the
    coarsest pyramid level once per slide: a tile is kept when at least ``min_tissue`` of its
    footprint is stained tissue by ``tissue`` (``min_tissue=0`` keeps all). Labels come from the first
    folder below ``root`` when the slides sit in class folders. ``opener`` opens a slide file
    (OpenSlide by default; a wrapper may record or cache reads)."""

    def __init__(self, slides: Sequence[str | Path], image_size: int, *, level: int = 0, min_tissue: float = 0.5,
                 root: str | Path | None = None, num_classes: int | None = None,
                 max_tiles_per_slide: int | None = None, classes: Sequence[str] | None = None,
                 opener: Callable[[Path], Slide] = open_slide, mpp: float | None = None,
                 source_mpp: float | None = None, tissue: TissueMethod = TissueMethod.SATURATION) -> None:
        from .resolution import common_mpp, slide_choice

        if image_size < 1:
            raise ValueError(f"--image-size must be >= 1, got {image_size}")
        if not 0.0 <= min_tissue <= 1.0:
            raise ValueError(f"min_tissue must be in [0, 1], got {min_tissue}")
        self.paths = [require_path(p) for p in slides]
        if not self.paths:
            raise FileNotFoundError("no slide given")
        self.image_size = image_size
        self.channels = 3
        self.level = level
        self.min_tissue = min_tissue
        self.tissue = tissue
        base = Path(root) if root is not None else self.paths[0].parent
        self.slide_labels, self.classes = (class_of(self.paths, base, classes) if root is not None
                                           else ([0] * len(self.paths), [""]))
        self.num_classes = check_classes(len(self.classes), num_classes, base)
        self._opener = opener
        self._open: dict[int, Slide] = {}
        self.downsample: list[float] = []
        self.choices: list[LevelChoice] = []      # per slide: the level read and the resampling to --mpp
        self.bounds: list[SlideBounds] = []       # per slide: OpenSlide's bounds (QuPath's image), data/bounds.py
        self.tiles: list[SlideTile] = []
        for number, path in enumerate(self.paths):
            slide = self.slide(number)
            if not 0 <= level < slide.level_count:
                raise ValueError(f"slide level {level} does not exist in {path} (levels 0.."
                                 f"{slide.level_count - 1}); choose a level in that range")
            choice = slide_choice(slide, path, level, mpp, source_mpp)
            self.choices.append(choice)
            self.bounds.append(bounds_of(slide))   # QuPath's image of the slide: tiles and annotations in its pixels
            width, height = read_extent(slide, choice)
            if image_size > min(width, height):
                raise ValueError(f"--image-size {image_size} is larger than slide {path} at level "
                                 f"{level} ({width}x{height}); use --image-size <= "
                                 f"{min(width, height)} or a finer level")
            self.downsample.append(float(slide.level_downsamples[choice.level]))
            kept = self._tissue_tiles(number, width, height)
            self.tiles += kept[:max_tiles_per_slide] if max_tiles_per_slide else kept
        if not self.tiles:
            raise ValueError(f"no {image_size}px tile at level {level} has {min_tissue:.0%} tissue "
                             f"in {', '.join(map(str, self.paths))}; lower min_tissue")
        self.mpp = common_mpp(c.mpp for c in self.choices)      # µm per pixel trained at (None: unknown, mixed)

    def slide(self, number: int) -> Slide:
        """The (lazily opened, cached) OpenSlide of slide ``number``."""
        if number not in self._open:
            self._open[number] = self._opener(self.paths[number])
        return self._open[number]

    def _tissue_tiles(self, number: int, width: int, height: int) -> list[SlideTile]:
        size = self.image_size
        corners = [(x, y) for y in range(0, height - size + 1, size)
                   for x in range(0, width - size + 1, size)]
        if self.min_tissue <= 0:
            return [SlideTile(number, x, y) for x, y in corners]
        mask = coarse_tissue(self.slide(number), self.tissue)
        ch, cw = mask.shape
        sx, sy = cw / width, ch / height
        kept = []
        for x, y in corners:
            r0, r1 = int(y * sy), max(int(y * sy) + 1, int(round((y + size) * sy)))
            c0, c1 = int(x * sx), max(int(x * sx) + 1, int(round((x + size) * sx)))
            if mask[r0:r1, c0:c1].mean() >= self.min_tissue:
                kept.append(SlideTile(number, x, y))
        return kept

    def __len__(self) -> int:
        return len(self.tiles)

    def label(self, index: int) -> int:
        return self.slide_labels[self.tiles[index].slide]

    def stain_key(self, index: int) -> tuple[str, int]:
        """A slide's tiles share its stain (estimated from its overview, as inference does)."""
        return ("slide", self.tiles[index].slide)

    def stain_pixels(self, index: int) -> np.ndarray:
        return slide_overview(self.slide(self.tiles[index].slide))

    def read_pixels(self, index: int, box: Box | None = None) -> torch.Tensor:
        tile = self.tiles[index]
        r0, r1, c0, c1 = check_box(box, self.image_size)
        target = (tile.y + r0, tile.y + r1, tile.x + c0, tile.x + c1)
        return to_tensor(resolved_pixels(self.slide(tile.slide), self.choices[tile.slide], target))

    def close(self) -> None:
        """Close every open slide."""
        for slide in self._open.values():
            slide.close()
        self._open.clear()


def open_pathology(datapath: str | Path, image_size: int, *, level: int = 0, min_tissue: float = 0.5,
                   num_classes: int | None = None, exclude: Collection[Path] = (), classes: Sequence[str] | None = None,
                   mpp: float | None = None, source_mpp: float | None = None,
                   tissue: TissueMethod = TissueMethod.SATURATION) -> TileFolderDataset | SlideDataset:
    """``--app medical --datapath``: a slide file, a folder with slides (by class folder), or a tile folder;
    ``classes``: the class folders' names in label order (default: sorted); ``tissue``: how slides' tissue tiles
    are found."""
    path = require_path(datapath)
    if path.is_file():
        if path.suffix.lower() not in SLIDE_ONLY_EXTENSIONS + (".tif", ".tiff"):
            raise ValueError(f"--datapath {str(path)!r} is a file but not a slide "
                             f"({', '.join(SLIDE_ONLY_EXTENSIONS)}, .tif); give a slide or a folder")
        return SlideDataset([path], image_size, level=level, min_tissue=min_tissue,
                            num_classes=num_classes, mpp=mpp, source_mpp=source_mpp, tissue=tissue)
    files, slides = folder_files(path, exclude, image_size)
    if slides:
        return SlideDataset(files, image_size, level=level, min_tissue=min_tissue, root=path,
                            num_classes=num_classes, classes=classes, mpp=mpp, source_mpp=source_mpp, tissue=tissue)
    return TileFolderDataset(path, image_size, num_classes=num_classes, files=files, classes=classes, mpp=mpp,
                             source_mpp=source_mpp)
