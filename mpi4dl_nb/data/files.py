"""General file helpers of the data sets: a path that must exist, class labels by folder, a folder's tiles or slides."""
from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

TILE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")
SLIDE_ONLY_EXTENSIONS = (".svs", ".ndpi", ".mrxs", ".scn", ".vms", ".vmu", ".bif", ".svslide")
ANNOTATION_SUFFIXES = (".geojson", ".json")      # a slide's QuPath annotations beside it (same stem)


def require_path(path: str | Path, knob: str = "--datapath") -> Path:
    """``path`` as a Path, or FileNotFoundError naming the knob."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{knob} {str(path)!r} does not exist; give a folder of tiles, a "
                                f"slide file or a folder of slides")
    return p


def class_of(paths: Sequence[Path], root: Path, order: Sequence[str] | None = None) -> tuple[list[int], list[str]]:
    """Labels from the first folder below ``root`` (sorted names, or the class names ``order`` in their order:
    ValueError for a folder not among them); one class when files sit in root."""
    names = [p.relative_to(root).parts[0] if len(p.relative_to(root).parts) > 1 else "" for p in paths]
    classes = list(order) if order else sorted(set(names))
    unknown = sorted(set(names) - set(classes))
    if unknown:
        shown = ", ".join(repr(n) if n else "files directly in the folder" for n in unknown)
        raise ValueError(f"{root} holds {shown}, not among the classes {', '.join(classes)}; put each image in "
                         f"the folder of its class")
    if any(names):
        check_no_empty_class(root, classes, set(names))
    return [classes.index(n) for n in names], classes


def check_no_empty_class(root: Path, classes: Sequence[str], found: Collection[str]) -> None:
    """ValueError naming every class folder below ``root`` (or class named) that holds none of the images read:
    an empty class would otherwise be dropped without a word."""
    folders = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")} if root.is_dir() else set()
    empty = sorted((folders | set(classes)) - set(found))
    if empty:
        shown = ", ".join(str(root / name) for name in empty)
        raise ValueError(f"class folder {shown} holds no images this run reads; add images to it, or remove it "
                         f"(with --classes: drop its name)")


@contextmanager
def quiet_tifffile() -> Iterator[None]:
    """tifffile logs damaged structures as warnings; the callers report them themselves."""
    logger = logging.getLogger("tifffile")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def tiff_pages(path: Path) -> tuple[int, tuple[int, int]] | None:
    """(pages, (width, height) of the first) of a TIFF from its headers only (None: not parseable as TIFF)."""
    import tifffile

    try:
        with quiet_tifffile(), tifffile.TiffFile(path) as tif:
            first = tif.pages.first
            return len(tif.pages), (int(first.imagewidth), int(first.imagelength))
    except Exception:
        return None


def holds_tiles(size: tuple[int, int], image_size: int | None) -> bool:
    """Whether an image of ``size`` (width, height) holds more than one ``image_size`` tile (a side at least twice
    it): a plain TIFF that large is a slide, tiled rather than centre-cropped."""
    return image_size is not None and max(size) >= 2 * image_size


def has_annotations(path: Path) -> bool:
    """Whether QuPath annotations lie beside ``path`` (``S.geojson`` or ``S.json`` for ``S.tif``)."""
    return any(path.with_suffix(suffix).is_file() for suffix in ANNOTATION_SUFFIXES)


def is_slide_file(path: Path, image_size: int | None = None) -> bool:
    """Whether ``path`` is a whole-slide image: a slide-only extension, a multi-page TIFF pyramid, a TIFF with its
    annotations beside it (a single-page tiled TIFF and its GeoJSON: annotated slides' layout), or a plain TIFF that
    holds more than one ``image_size`` tile (``holds_tiles``: read as a slide is, not centre-cropped). Judged from
    the headers (tifffile), so a slide with damaged image data is a slide (the data check reports it), not a tile."""
    suffix = path.suffix.lower()
    if suffix in SLIDE_ONLY_EXTENSIONS:
        return True
    if suffix in (".tif", ".tiff"):
        if (found := tiff_pages(path)) is not None:
            pages, size = found
            return pages > 1 or has_annotations(path) or holds_tiles(size, image_size)
        import openslide

        return openslide.OpenSlide.detect_format(str(path)) is not None
    return False


def folder_files(root: Path, exclude: Collection[Path] = (), image_size: int | None = None) -> tuple[list[Path], bool]:
    """The files a folder dataset reads and whether they are slides. A folder holding any slide is a folder of slides:
    then every slide-only file and every TIFF is one (a TIFF that cannot be a slide is reported by the data check, not
    dropped). Otherwise it is a folder of tiles. ``exclude`` drops files (``--skip-bad-files``); ``image_size``: a
    plain TIFF holding several such tiles is a slide."""
    drop = {Path(p).resolve() for p in exclude}
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.resolve() not in drop)
    if any(is_slide_file(p, image_size) for p in files):
        return [p for p in files if p.suffix.lower() in SLIDE_ONLY_EXTENSIONS + (".tif", ".tiff")], True
    return [p for p in files if p.suffix.lower() in TILE_EXTENSIONS], False
