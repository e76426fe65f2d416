"""Data checked before training: which files a dataset reads, whether each is usable, a fingerprint of the data."""
from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from .apps import AppKind
from .dataset import RegionDataset
from .files import SLIDE_ONLY_EXTENSIONS, folder_files, quiet_tifffile, require_path

# PIL modes a tile may have: 8 bits per channel, converted to RGB on read
TILE_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr")
JPEG_TAIL = 4096   # bytes searched for the end-of-image marker


class SourceKind(str, Enum):
    """What the files of a dataset are."""

    TILES = "tiles"
    SLIDES = "slides"


@dataclass(frozen=True)
class DataSources:
    """The files a dataset reads (empty for generated data and the bundled sample)."""

    kind: SourceKind | None
    files: tuple[Path, ...] = ()


def find_sources(app: AppKind | str, datapath: str | Path | None, knob: str = "--datapath",
                 image_size: int | None = None) -> DataSources:
    """The files ``--app``/``datapath`` will read, found without opening them (as ``make_dataset`` finds them: a
    plain TIFF holding several ``image_size`` tiles is a slide); FileNotFoundError naming ``knob`` when a path of an
    app that reads files does not exist."""
    kind = AppKind.parse(app)
    if datapath is None or not kind.reads_datapath:
        return DataSources(None)
    root = require_path(datapath, knob)
    if kind is not AppKind.MEDICAL:
        return DataSources(None)
    if root.is_file():
        return DataSources(SourceKind.SLIDES, (root,))
    files, slides = folder_files(root, image_size=image_size)
    return DataSources(SourceKind.SLIDES if slides else SourceKind.TILES, tuple(files))


def check_file(path: Path, kind: SourceKind, image_size: int, level: int = 0) -> str | None:
    """Why ``path`` cannot be trained on (None: usable). Reads headers and structure, not every pixel."""
    try:
        if kind is SourceKind.SLIDES:
            return _check_slide(path, image_size, level)
        return _check_tile(path, image_size)
    except Exception as err:   # any failure to read is a property of the file
        return f"unreadable: {type(err).__name__}: {err}"


def _check_tile(path: Path, image_size: int) -> str | None:
    from PIL import Image

    try:
        img = Image.open(path)
    except Exception as err:
        return f"unreadable image: {err}"
    with img:
        width, height = img.size
        if img.mode not in TILE_MODES:
            return f"pixel mode {img.mode} is not 8-bit grey/colour; convert it to 8-bit RGB"
        if min(width, height) < image_size:
            return f"{width}x{height}, smaller than --image-size {image_size}"
        fmt = img.format
        if fmt == "PNG":
            try:
                img.verify()           # every chunk's CRC and the end chunk, without decoding
            except Exception as err:
                return f"damaged or truncated PNG: {err}"
            return None
    if fmt == "JPEG":
        return _check_jpeg_end(path)
    if fmt == "TIFF":
        return _check_tiff_extent(path)
    with Image.open(path) as again:   # other formats: decode (BMP is uncompressed and cheap)
        try:
            again.load()
        except Exception as err:
            return f"damaged or truncated {fmt}: {err}"
    return None


def _check_jpeg_end(path: Path) -> str | None:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        handle.seek(max(0, size - JPEG_TAIL))
        tail = handle.read()
    if b"\xff\xd9" not in tail:
        return "truncated JPEG: no end-of-image marker"
    return None


def _check_tiff_extent(path: Path) -> str | None:
    """Every page's image data must lie inside the file (a cut-off TIFF fails here)."""
    import tifffile

    size = path.stat().st_size
    with quiet_tifffile(), tifffile.TiffFile(path) as tif:
        for number, page in enumerate(tif.pages):
            offsets = getattr(page, "dataoffsets", ()) or ()
            counts = getattr(page, "databytecounts", ()) or ()
            end = max((o + c for o, c in zip(offsets, counts) if c), default=0)
            if end > size:
                return f"truncated TIFF: page {number} needs {end} bytes, the file has {size}"
    return None


def _check_slide(path: Path, image_size: int, level: int) -> str | None:
    from .pathology import open_slide

    if path.suffix.lower() in (".tif", ".tiff", ".svs"):
        try:
            problem = _check_tiff_extent(path)
        except Exception as err:
            return f"damaged TIFF structure: {err}"
        if problem is not None:
            return problem
    try:
        slide = open_slide(path)              # as training opens it: a plain TIFF through Pillow
    except ValueError as err:
        return str(err).removeprefix(f"cannot read slide {path}: ")
    try:
        if not 0 <= level < slide.level_count:
            return f"has no level {level} (levels 0..{slide.level_count - 1})"
        width, height = slide.level_dimensions[level]
        if min(width, height) < image_size:
            return f"level {level} is {width}x{height}, smaller than --image-size {image_size}"
        coarse = slide.level_count - 1
        slide.read_region((0, 0), coarse, (1, 1))
    finally:
        slide.close()
    return None


def check_files(paths: Collection[Path], kind: SourceKind, image_size: int, level: int = 0,
                progress: Callable[[int, int], object] | None = None,
                checker: Callable[[Path], str | None] | None = None) -> list[tuple[Path, str]]:
    """``(path, reason)`` of every unusable file among ``paths``; ``progress(done, total)`` after each.
    ``checker(path)`` (default ``check_file``) says why a file is unusable (e.g. an image and its mask)."""
    bad = []
    for done, path in enumerate(paths, 1):
        reason = checker(path) if checker is not None else check_file(path, kind, image_size, level)
        if reason is not None:
            bad.append((path, reason))
        if progress is not None:
            progress(done, len(paths))
    return bad


def classes_found(dataset: RegionDataset) -> int | None:
    """How many classes the files of ``dataset`` show (None: labels are not taken from files)."""
    classes = getattr(dataset, "classes", None)
    return len(classes) if isinstance(classes, (list, tuple)) else None


def dataset_fingerprint(dataset: RegionDataset) -> dict[str, object]:
    """What identifies a dataset's content cheaply: file names relative to its root, sizes, labels, count."""
    files = getattr(dataset, "files", None) or getattr(dataset, "paths", None)
    if files:
        root = Path(os.path.commonpath([str(p) for p in files])) if len(files) > 1 else Path(files[0]).parent
        listing = [(str(Path(p).relative_to(root)), Path(p).stat().st_size) for p in files]
        extra = {"tiles": len(dataset), "level": getattr(dataset, "level", None)}
        return {"kind": type(dataset).__name__, "files": listing, **extra,
                "labels": [dataset.label(i) for i in range(len(dataset))]}
    return {"kind": type(dataset).__name__, "images": len(dataset),
            "image_size": getattr(dataset, "image_size", None)}


def excluded(paths: Collection[Path], bad: Collection[Path]) -> list[Path]:
    """``paths`` without the ``bad`` ones (compared resolved)."""
    drop = {Path(p).resolve() for p in bad}
    return [p for p in paths if Path(p).resolve() not in drop]


__all__ = ["DataSources", "SLIDE_ONLY_EXTENSIONS", "SourceKind", "check_file", "check_files",
           "classes_found", "dataset_fingerprint", "excluded", "find_sources"]
