"""Slide region reads (OpenSlide, or a plain image) zero-extended past the slide."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import ConfigError
from ..data.bounds import SlideBounds, slide_bounds
from ..data.pathology import Slide, rgba_to_rgb
from ..data.resolution import AreaResampler, image_mpp, properties_mpp, resolve_read
from ..spatial.geometry import Box

TILE_CACHE_BYTES = 8 << 20   # OpenSlide's decoded-tile cache until the runner sizes it to the window


class SlideReader:
    """A slide at one resolution: ``read(box)`` gives ``box``'s RGB pixels (uint8 H x W x 3), zeros past the edges.

    Coordinates are those of QuPath's image of the slide: within OpenSlide's bounds
    (``data/bounds.py``; the whole frame when the format reports none), so every output
    made from these reads lines up with QuPath's view and its annotations.

    Anything OpenSlide opens, or a plain image (PNG/JPEG/TIFF through Pillow, loaded whole:
    keep those small, convert big ones to a pyramidal TIFF). The pixels are those of pyramid
    level ``choice.level``, shrunk by ``choice.scale`` when a resolution between levels is asked
    for (``data/resolution.py``: exact box by box). OpenSlide's tile cache is capped
    (``limit_cache``), so memory does not grow with the slide.
    """

    def __init__(self, path: str | Path, level: int | None = None, *, mpp: float | None = None,
                 trained_at: float | None = None, source_mpp: float | None = None) -> None:
        import openslide

        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise FileNotFoundError(f"--slide {str(path)!r}: no such file")
        try:
            self.slide: Slide = openslide.open_slide(str(self.path))
            self.slide.level_dimensions   # noqa: B018 - an ImageSlide decodes lazily: fail here
        except Exception as err:   # OpenSlide/Pillow raise many kinds
            raise ValueError(f"--slide {self.path}: cannot be opened as a slide or an image "
                             f"({type(err).__name__}: {err}); OpenSlide reads .svs/.ndpi/.mrxs/.scn/pyramidal "
                             f".tif..., Pillow reads .png/.jpg/.tif") from err
        if level is not None and not 0 <= level < self.slide.level_count:
            count = self.slide.level_count
            raise ConfigError("--slide-level", f"{self.path} has levels 0..{count - 1}, not {level}; "
                              f"choose a level in that range")
        self.limit_cache(TILE_CACHE_BYTES)
        self.base_mpp = source_mpp if source_mpp is not None else self.file_mpp()
        downsamples = [float(d) for d in self.slide.level_downsamples]
        self.choice = resolve_read(self.base_mpp, downsamples, str(self.path), target=mpp, level=level,
                                   trained_at=trained_at)
        self.level = self.choice.level
        self.bounds: SlideBounds = slide_bounds(getattr(self.slide, "properties", {}), self.frame_size)
        self.level_downsample = downsamples[self.level]
        self.level_width, self.level_height = self.bounds.level_size(self.level_downsample,
                                                                     self.slide.level_dimensions[self.level])
        self.resampler = AreaResampler(self.choice.scale) if self.choice.resampled else None
        if self.resampler is None:
            self.width, self.height = self.level_width, self.level_height
        else:
            self.width, self.height = self.resampler.extent(self.level_width), self.resampler.extent(self.level_height)
        self.downsample = self.level_downsample * self.choice.scale   # level-0 pixels per pixel read
        self.mpp = self.choice.mpp

    def read_description(self) -> str:
        """How the pixels read come from the slide: the level, its size, the shrink and the resolution."""
        text = f"level {self.level}, {self.level_width}x{self.level_height} px"
        if self.resampler is not None:
            text += f", shrunk by {self.choice.scale:g}"
        return text + ("" if self.mpp is None else f", {self.mpp:g} µm/px")

    def file_mpp(self) -> float | None:
        """Level 0's MPP as the file says (OpenSlide properties; a plain image's resolution tags)."""
        properties = getattr(self.slide, "properties", {})
        found = properties_mpp(properties, str(self.path))
        return found if found is not None or properties else image_mpp(self.path)

    def limit_cache(self, capacity: int) -> None:
        """Cap OpenSlide's decoded-tile cache at ``capacity`` bytes (the runner: a few windows' worth)."""
        import openslide

        set_cache = getattr(self.slide, "set_cache", None)
        if set_cache is not None and hasattr(openslide, "OpenSlideCache"):
            set_cache(openslide.OpenSlideCache(max(1, int(capacity))))

    @property
    def levels(self) -> list[tuple[int, int]]:
        """(width, height) of every level of QuPath's image (the bounds)."""
        return [self.bounds.level_size(float(d), size)
                for d, size in zip(self.slide.level_downsamples, self.slide.level_dimensions)]

    @property
    def frame_size(self) -> tuple[int, int]:
        """(width, height) of OpenSlide's level-0 frame (the bounds lie inside it)."""
        width, height = self.slide.level_dimensions[0]
        return int(width), int(height)

    @property
    def level0_size(self) -> tuple[int, int]:
        """(height, width) of level 0 of QuPath's image (the bounds)."""
        return self.bounds.height, self.bounds.width

    def read(self, box: Box) -> np.ndarray:
        """RGB uint8 pixels of ``box`` (r0, r1, c0, c1) at this resolution; zero outside the slide."""
        if self.resampler is None:
            return self.read_level(box)
        r0, r1, c0, c1 = box
        out = self.resampler.read(self.read_level, box)
        out[max(0, min(r1, self.height) - r0):] = 0          # past the resampled extent: zero, as past a level
        out[:, max(0, min(c1, self.width) - c0):] = 0
        return out

    def read_level(self, box: Box) -> np.ndarray:
        """RGB uint8 pixels of ``box`` at the pyramid level read; zero outside it."""
        r0, r1, c0, c1 = box
        out = np.zeros((r1 - r0, c1 - c0, 3), dtype=np.uint8)
        y0, y1 = max(r0, 0), min(r1, self.level_height)
        x0, x1 = max(c0, 0), min(c1, self.level_width)
        if y0 < y1 and x0 < x1:
            location = (self.bounds.x + int(round(x0 * self.level_downsample)),
                        self.bounds.y + int(round(y0 * self.level_downsample)))
            region = self.slide.read_region(location, self.level, (x1 - x0, y1 - y0))
            out[y0 - r0:y1 - r0, x0 - c0:x1 - c0] = rgba_to_rgb(region)
        return out

    def thumbnail(self, max_side: int) -> np.ndarray:
        """An RGB overview of the slide's bounds at most ``max_side`` pixels wide or high (from a coarse level)."""
        frame_width, frame_height = self.frame_size
        bounds = self.bounds
        scale = max_side / max(bounds.width, bounds.height)
        side = max(1, min(int(round(max(frame_width, frame_height) * scale)), 8 * max_side))
        image = np.asarray(self.slide.get_thumbnail((side, side)).convert("RGB"))
        sy, sx = image.shape[0] / frame_height, image.shape[1] / frame_width
        top, left = int(round(bounds.y * sy)), int(round(bounds.x * sx))
        rows, cols = max(1, int(round(bounds.height * sy))), max(1, int(round(bounds.width * sx)))
        return image[top:top + rows, left:left + cols]

    def close(self) -> None:
        self.slide.close()
