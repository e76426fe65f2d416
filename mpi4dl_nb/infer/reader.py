"""Slide region reads (OpenSlide, or a plain image) zero-extended past the slide, and a prefetch thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Generic, TypeVar

import numpy as np

from ..config import ConfigError
from ..data.pathology import Slide, rgba_to_rgb
from ..spatial.geometry import Box

TILE_CACHE_BYTES = 8 << 20   # OpenSlide's decoded-tile cache until the runner sizes it to the window
Item = TypeVar("Item")
Result = TypeVar("Result")


class SlideReader:
    """One level of a slide: ``read(box)`` gives ``box``'s RGB pixels (uint8 H x W x 3), zeros past the edges.

    Anything OpenSlide opens, or a plain image (PNG/JPEG/TIFF through Pillow, loaded whole:
    keep those small, convert big ones to a pyramidal TIFF). Reads are in pixels of ``level``.
    OpenSlide's tile cache is capped (``limit_cache``), so memory does not grow with the slide.
    """

    def __init__(self, path: str | Path, level: int = 0) -> None:
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
        if not 0 <= level < self.slide.level_count:
            count = self.slide.level_count
            raise ConfigError("--slide-level", f"{self.path} has levels 0..{count - 1}, not {level}; "
                              f"choose a level in that range")
        self.limit_cache(TILE_CACHE_BYTES)
        self.level = level
        self.width, self.height = (int(v) for v in self.slide.level_dimensions[level])
        self.downsample = float(self.slide.level_downsamples[level])

    def limit_cache(self, capacity: int) -> None:
        """Cap OpenSlide's decoded-tile cache at ``capacity`` bytes (the runner: a few windows' worth)."""
        import openslide

        set_cache = getattr(self.slide, "set_cache", None)
        if set_cache is not None and hasattr(openslide, "OpenSlideCache"):
            set_cache(openslide.OpenSlideCache(max(1, int(capacity))))

    @property
    def levels(self) -> list[tuple[int, int]]:
        """(width, height) of every level."""
        return [(int(w), int(h)) for w, h in self.slide.level_dimensions]

    def read(self, box: Box) -> np.ndarray:
        """RGB uint8 pixels of ``box`` (r0, r1, c0, c1) at this level; zero outside the slide."""
        r0, r1, c0, c1 = box
        out = np.zeros((r1 - r0, c1 - c0, 3), dtype=np.uint8)
        y0, y1, x0, x1 = max(r0, 0), min(r1, self.height), max(c0, 0), min(c1, self.width)
        if y0 < y1 and x0 < x1:
            location = (int(round(x0 * self.downsample)), int(round(y0 * self.downsample)))
            region = self.slide.read_region(location, self.level, (x1 - x0, y1 - y0))
            out[y0 - r0:y1 - r0, x0 - c0:x1 - c0] = rgba_to_rgb(region)
        return out

    def thumbnail(self, max_side: int) -> np.ndarray:
        """An RGB overview of the whole slide at most ``max_side`` pixels wide or high (from a coarse level)."""
        image = self.slide.get_thumbnail((max_side, max_side)).convert("RGB")
        return np.asarray(image)

    def close(self) -> None:
        self.slide.close()


class Prefetcher(Generic[Item, Result]):
    """Runs ``load(item)`` for each item in a background thread, at most ``depth`` results ahead.

    Iterating yields ``(item, result)`` in order; an exception in the thread is raised in the
    consumer. Reads then overlap the consumer's compute (OpenSlide and numpy release the GIL).
    """

    def __init__(self, items: Iterable[Item], load: Callable[[Item], Result], depth: int = 1) -> None:
        # (item, result) in order, then None at the end; an exception in the thread travels as itself
        self._queue: queue.Queue[tuple[Item, Result] | BaseException | None] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self.wait_seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(iter(items), load), daemon=True,
                                        name="mpi4dl-prefetch")
        self._thread.start()

    def _run(self, items: Iterator[Item], load: Callable[[Item], Result]) -> None:
        try:
            for item in items:
                if self._stop.is_set():
                    return
                self._put((item, load(item)))
        except BaseException as err:   # handed to the consumer
            self._put(err)
            return
        self._put(None)

    def _put(self, value: tuple[Item, Result] | BaseException | None) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(value, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[tuple[Item, Result]]:
        import time

        while True:
            start = time.perf_counter()
            value = self._queue.get()
            self.wait_seconds += time.perf_counter() - start
            if value is None:
                return
            if isinstance(value, BaseException):
                raise value
            yield value

    def close(self) -> None:
        """Stop the thread (also when the consumer stopped early)."""
        self._stop.set()
        self._thread.join(timeout=5)
