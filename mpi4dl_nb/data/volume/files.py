"""Volume files (multi-page TIFF stacks, NIfTI): their header (``volume_info``) and a sub-volume read (``read_volume``).

Axes are ``(D, H, W)`` everywhere: a TIFF stack is one page per depth slice (page rows are ``y``, columns
``x``); a NIfTI array is stored ``x, y, z`` and, when its header states its axes, is read in RAS axes (``D, H, W``
= inferior to superior, posterior to anterior, left to right: its axes swapped and reversed exactly, no
resampling, ``orientation.py``), else as ``z, y, x`` of its own array. ``read_volume`` returns ``(C, d, h, w)`` of
the file's dtype (a NIfTI with a scale slope or intercept reads as float64). Voxel sizes are along ``D, H, W`` in
micrometres, ``None`` when the file does not say all three (TIFF: OME ``PhysicalSizeX/Y/Z`` or the ImageJ
``spacing`` with the X/YResolution tags and ``unit``; NIfTI: the header zooms with its spatial unit). A NIfTI's
header geometry (``space.ScanSpace``) travels in ``VolumeInfo.space`` for the outputs that overlay it. An ImageJ
stack whose metadata calls its pages channels (``tifffile.imwrite(..., imagej=True)`` without ``axes='ZYX'``) is
read as the depth slices they are when ImageJ shows them as grey levels; shown as colours, it is refused saying so.

A region reads only its sub-volume: a TIFF stack decodes only the pages of its depth range (an uncompressed
contiguous stack is memory-mapped, so only the region's bytes are read); a NIfTI slices its ``dataobj``.
A file that cannot be read as a volume raises ``ConfigError`` naming the file; a TIFF cut short (a copy or download
that stopped) is said to be truncated, with the pages that can be read and what its metadata promised.
"""
from __future__ import annotations

import json
import logging
import re
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ...errors import ConfigError
from .orientation import GRID, Orientation
from .space import ScanSpace

if TYPE_CHECKING:
    import tifffile
    from nibabel.nifti1 import Nifti1Pair

TIFF_SUFFIXES = (".tif", ".tiff")
NIFTI_SUFFIXES = (".nii", ".nii.gz")
VOLUME_SUFFIXES = TIFF_SUFFIXES + NIFTI_SUFFIXES
Region = tuple[slice, slice, slice]
VoxelSize = tuple[float, float, float]

MICROMETRES_PER_UNIT = {
    "m": 1e6, "meter": 1e6, "cm": 1e4, "centimeter": 1e4, "mm": 1e3, "millimeter": 1e3,
    "um": 1.0, "µm": 1.0, "\u03bcm": 1.0, "micron": 1.0, "microns": 1.0, "micrometer": 1.0, "micrometre": 1.0,
    "nm": 1e-3, "nanometer": 1e-3, "inch": 25400.0,
}
TIFF_RESOLUTION_UNITS = {2: "inch", 3: "cm"}   # ResolutionUnit tag: 1 = none (ImageJ then says ``unit``)
CHANNEL_AXES = ("C", "S")
PAGE_AXES = ("Y", "X", "S")
IMAGEJ_GREY = "grayscale"     # ImageJ's display of channels as grey levels (colours: "composite", "color")


@dataclass(frozen=True)
class VolumeInfo:
    """What a volume file holds, read from its header/tags only."""

    path: Path
    shape: tuple[int, int, int]                 # (D, H, W) as read
    channels: int
    dtype: np.dtype
    voxel_size: VoxelSize | None               # along (D, H, W) in micrometres, None when the file does not say
    space: ScanSpace | None = None             # a NIfTI's header geometry (None: a TIFF stack)
    scaling: tuple[float, float] | None = None  # a NIfTI's scl_slope and scl_inter when they change the values

    @property
    def orientation(self) -> Orientation:
        """How the file's grid is read (``GRID``: as stored)."""
        return GRID if self.space is None else self.space.orientation

    def shape_as(self, orientation: Orientation) -> tuple[int, int, int]:
        """The ``(D, H, W)`` of this file read in ``orientation`` (a label volume read beside its image)."""
        return orientation.read_shape(self.orientation.grid_shape(self.shape))


def volume_suffix(path: str | Path) -> str:
    """The volume suffix of ``path`` (``.tif``, ``.tiff``, ``.nii``, ``.nii.gz``), or ``""`` when it has none."""
    name = Path(path).name.lower()
    return next((s for s in sorted(VOLUME_SUFFIXES, key=len, reverse=True) if name.endswith(s)), "")


def volume_stem(path: str | Path) -> str:
    """The file name without its volume suffix (``a.nii.gz`` -> ``a``)."""
    name = Path(path).name
    return name[: len(name) - len(volume_suffix(name))] if volume_suffix(name) else Path(name).stem


def is_volume_file(path: str | Path) -> bool:
    """Whether ``path`` has a volume suffix."""
    return bool(volume_suffix(path))


def volume_info(path: str | Path) -> VolumeInfo:
    """The shape ``(D, H, W)``, channels, dtype and voxel size of a volume file, from its header only."""
    file = Path(path).expanduser()
    with _refusing(file):
        if volume_suffix(file) in NIFTI_SUFFIXES:
            return _nifti_info(file)
        if volume_suffix(file) in TIFF_SUFFIXES:
            with _open_tiff(file) as (tif, complaints):
                return _TiffStack.of(file, tif, complaints).info(tif, complaints)
    raise ConfigError(str(file), f"not a volume file: use one of {', '.join(VOLUME_SUFFIXES)}")


def read_volume(path: str | Path, region: Region | None = None, orientation: Orientation | None = None) -> np.ndarray:
    """The voxels of ``region`` (slices of ``D, H, W``; all when None) as ``(C, d, h, w)``, reading only that region;
    a NIfTI read in ``orientation`` (default: its own, ``VolumeInfo.orientation``)."""
    file = Path(path).expanduser()
    with _refusing(file):
        if volume_suffix(file) in NIFTI_SUFFIXES:
            return _read_nifti(file, region, orientation)
        if volume_suffix(file) in TIFF_SUFFIXES:
            with _open_tiff(file) as (tif, complaints):
                return _TiffStack.of(file, tif, complaints).read(file, tif, region, complaints)
    raise ConfigError(str(file), f"not a volume file: use one of {', '.join(VOLUME_SUFFIXES)}")


def region_ranges(region: Region | None, shape: tuple[int, int, int]) -> tuple[range, range, range]:
    """The index ranges of ``region`` inside ``shape`` (steps of 1 only)."""
    region = region if region is not None else (slice(None),) * 3
    if len(region) != 3:
        raise ValueError(f"a volume region is 3 slices (D, H, W), got {len(region)}")
    ranges = []
    for part, size in zip(region, shape, strict=True):
        start, stop, step = part.indices(size)
        if step != 1:
            raise ValueError(f"a volume region has steps of 1, got {part}")
        ranges.append(range(start, max(start, stop)))
    return ranges[0], ranges[1], ranges[2]


@contextmanager
def _refusing(file: Path) -> Iterator[None]:
    """Turn a reader's failure into one ConfigError naming the file."""
    if not file.is_file():
        raise ConfigError(str(file), "no such volume file")
    try:
        yield
    except ConfigError:
        raise
    except Exception as err:   # every reader failure (damaged header, unsupported layout) names the file
        raise ConfigError(str(file), f"cannot read it as a volume ({type(err).__name__}: {err})") from err


class _Complaints(logging.Handler):
    """What tifffile logs about a file while it is open (a page chain leading past the file's end, an unreadable
    tag), kept for the refusal that names the file rather than printed."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def _open_tiff(file: Path) -> Iterator[tuple[tifffile.TiffFile, list[str]]]:
    """The open TIFF and what tifffile complained of while reading it (``_Complaints``)."""
    import tifffile

    logger = logging.getLogger("tifffile")
    level = logger.level
    complaints = _Complaints()
    logger.setLevel(logging.ERROR)
    logger.addHandler(complaints)
    try:
        try:
            tif = tifffile.TiffFile(file)
        except Exception as err:   # its page chain broken past repair: said so when tifffile saw why
            if not complaints.messages:
                raise
            raise ConfigError(str(file), f"truncated or damaged: the file ends at byte {file.stat().st_size} "
                                         f"({_said(complaints.messages)}): copy or export the file again") from err
        with tif:
            yield tif, complaints.messages
    finally:
        logger.removeHandler(complaints)
        logger.setLevel(level)


def _said(complaints: list[str]) -> str:
    """tifffile's first complaint, without the object it names (``<tifffile.TiffPages @8> invalid page offset 8448``
    -> ``tifffile: invalid page offset 8448``)."""
    return "tifffile: " + re.sub(r"^<[^>]*>\s*", "", complaints[0])


def _promised_pages(tif: tifffile.TiffFile) -> str:
    """What the first page's description says the file holds (ImageJ's ``images=``, tifffile's ``{"shape": ...}``),
    "" when it says neither. Read from that page alone: the series of a file cut short cannot be formed."""
    try:
        text = str(tif.pages.first.description or "")
    except Exception:   # the first page itself is cut off
        return ""
    if text.startswith("ImageJ="):
        fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        return f"; its ImageJ metadata promises {fields['images']} pages" if "images" in fields else ""
    try:
        shape = json.loads(text).get("shape")
    except (ValueError, AttributeError):
        return ""
    return f"; its metadata promises shape {tuple(shape)}" if isinstance(shape, list) else ""


def _data_end(page: tifffile.TiffPage | tifffile.TiffFrame) -> int:
    """The byte after the last of ``page``'s image data."""
    return max((o + n for o, n in zip(page.dataoffsets, page.databytecounts)), default=0)


def _truncated(file: Path, tif: tifffile.TiffFile, complaints: list[str]) -> ConfigError | None:
    """The refusal of a TIFF cut short or damaged (tifffile lost its page chain, or a page's data lies past the
    file's end), naming what could be read and what the file promised; None for a whole file."""
    size, least = file.stat().st_size, ""
    try:
        pages = list(tif.pages)
    except Exception as err:   # a page past the first is unreadable: what tifffile found is said below
        complaints, pages, least = [*complaints, f"{type(err).__name__}: {err}"], [tif.pages.first], "at least "
    cut = [i for i, page in enumerate(pages) if page is not None and _data_end(page) > size]
    if not complaints and not cut:
        return None
    readable = len(pages) - len(cut)
    found = _said(complaints) if complaints else f"page {cut[0]}'s data ends at byte {_data_end(pages[cut[0]])}"
    return ConfigError(str(file), f"truncated or damaged: the file ends at byte {size} ({found}); {least}"
                                  f"{readable} whole page{'s' if readable != 1 else ''} of "
                                  f"{tuple(tif.pages.first.shape)} can be read{_promised_pages(tif)}: a volume "
                                  f"is one page per depth slice, so copy or export the file again")


def _micrometres(value: float, unit: str | None) -> float | None:
    """``value`` in ``unit`` as micrometres; None for an unknown unit."""
    factor = MICROMETRES_PER_UNIT.get((unit or "").strip().lower().replace("\\u00b5", "µ"))
    return None if factor is None else float(value) * factor


@dataclass(frozen=True)
class _TiffStack:
    """Where the depth slices and channels of a TIFF series sit: its unsqueezed page-index axes and page axes."""

    series_shape: tuple[int, ...]      # the leading (page-index) axes, unsqueezed
    depth_axis: int                    # index into series_shape
    channel_axis: int | None           # index into series_shape when channels are pages (OME/ImageJ C)
    page_shape: tuple[int, ...]        # (Y, X) or (Y, X, S)

    @staticmethod
    def of(file: Path, tif: tifffile.TiffFile, complaints: list[str]) -> _TiffStack:
        """The stack of ``tif``'s first series; ConfigError naming the file when it is not a volume, or cut short
        (``complaints``: what tifffile logged while reading it)."""
        try:
            return _TiffStack._of(file, tif)
        except Exception as err:   # a flat or odd layout, or a page chain tifffile cannot follow: truncated?
            truncated = _truncated(file, tif, complaints)
            if truncated is not None:
                raise truncated from err
            raise

    @staticmethod
    def _of(file: Path, tif: tifffile.TiffFile) -> _TiffStack:
        if not tif.series:
            raise ConfigError(str(file), "a TIFF with no image series")
        series = tif.series[0]
        axes, shape = series.get_axes(False), tuple(series.get_shape(False))
        page_axes = series.keyframe.axes
        if page_axes not in ("YX", "YXS"):
            raise ConfigError(str(file), f"a single-page image (axes {series.axes}, shape {series.shape}), "
                                         f"not a volume: write one page per depth slice")
        if not axes.endswith("YX") and not axes.endswith("YXS"):
            raise ConfigError(str(file), f"unsupported TIFF layout (axes {axes})")
        lead = len(axes) - (3 if axes.endswith("S") else 2)     # an unsqueezed S of 1 when the page has none
        stack_axes = [i for i in range(lead) if shape[i] > 1 and axes[i] != "C"]
        channel_axes = [i for i in range(lead) if shape[i] > 1 and axes[i] == "C"]
        if not stack_axes and channel_axes:        # every page a "channel": depth slices ImageJ mislabels?
            _check_channel_pages(file, tif, series.axes, tuple(series.shape), shape[channel_axes[0]])
            stack_axes, channel_axes = channel_axes, []
        if not stack_axes:
            raise ConfigError(str(file), f"a 2-D image (one page, shape {series.shape}), not a volume")
        if len(stack_axes) > 1:
            names = "".join(axes[i] for i in stack_axes)
            raise ConfigError(str(file), f"more than one stack axis ({names}, shape {series.shape}): "
                                         f"keep one volume (Z) per file")
        page_shape = tuple(series.keyframe.shape)
        if channel_axes and len(page_shape) == 3 and page_shape[2] > 1:
            raise ConfigError(str(file), "channels both as pages and as samples: unsupported TIFF layout")
        return _TiffStack(shape[:lead], stack_axes[0], channel_axes[0] if channel_axes else None, page_shape)

    @property
    def channels(self) -> int:
        if self.channel_axis is not None:
            return self.series_shape[self.channel_axis]
        return self.page_shape[2] if len(self.page_shape) == 3 else 1

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.series_shape[self.depth_axis], self.page_shape[0], self.page_shape[1]

    def info(self, tif: tifffile.TiffFile, complaints: list[str]) -> VolumeInfo:
        series = tif.series[0]
        file = Path(tif.filehandle.path)
        size = file.stat().st_size
        end = (series.dataoffset or 0) + series.nbytes if series.dataoffset is not None else \
            _data_end(_page(series, len(series.pages) - 1))      # contiguous voxels, else the last page's data
        if end > size:
            raise _truncated(file, tif, complaints) or ConfigError(
                str(file), f"truncated: its voxels end at byte {end}, the file at byte {size}; copy it again")
        return VolumeInfo(file, self.shape, self.channels, np.dtype(series.dtype),
                          _tiff_voxel_size(tif))

    def page_index(self, depth: int, channel: int) -> int:
        index = [0] * len(self.series_shape)
        index[self.depth_axis] = depth
        if self.channel_axis is not None:
            index[self.channel_axis] = channel
        return int(np.ravel_multi_index(index, self.series_shape))

    def read(self, file: Path, tif: tifffile.TiffFile, region: Region | None, complaints: list[str]) -> np.ndarray:
        """``region`` as ``(C, d, h, w)``; a failure of a file cut short is refused as such (``_truncated``)."""
        try:
            return self._read(file, tif, region)
        except ConfigError:
            raise
        except Exception as err:   # a memory map longer than the file, a decoder's failure on data cut short ...
            truncated = _truncated(file, tif, complaints)
            if truncated is None:
                raise
            raise truncated from err

    def _read(self, file: Path, tif: tifffile.TiffFile, region: Region | None) -> np.ndarray:
        depths, rows, cols = region_ranges(region, self.shape)
        series = tif.series[0]
        out = np.empty((self.channels, len(depths), len(rows), len(cols)), dtype=np.dtype(series.dtype))
        planes = self._contiguous_planes(file, tif)
        page_channels = self.channels if self.channel_axis is not None else 1
        for z_out, z in enumerate(depths):
            for c in range(page_channels):
                index = self.page_index(z, c)
                page = planes[index] if planes is not None else _page(series, index).asarray()
                part = page[rows.start:rows.stop, cols.start:cols.stop]
                if part.ndim == 3:      # samples (YXS): the channels of this page
                    out[:, z_out] = np.moveaxis(part, 2, 0)
                else:
                    out[c, z_out] = part
        return out

    def _contiguous_planes(self, file: Path, tif: tifffile.TiffFile) -> np.memmap | None:
        """The pages of an uncompressed contiguous series, memory-mapped (``(pages, *page_shape)``), else None."""
        series = tif.series[0]
        offset = series.dataoffset
        if offset is None or tif.filehandle.is_file is False:
            return None
        dtype = np.dtype(series.dtype).newbyteorder(tif.byteorder)
        pages = int(np.prod(self.series_shape))
        return np.memmap(file, dtype=dtype, mode="r", offset=offset, shape=(pages, *self.page_shape))


def _check_channel_pages(file: Path, tif: tifffile.TiffFile, axes: str, shape: tuple[int, ...], pages: int) -> None:
    """Accept the ``pages`` "channels" of an ImageJ stack with no slices or frames, shown as grey levels, as the
    depth slices they are (``tifffile.imwrite(..., imagej=True)`` without ``axes='ZYX'`` writes a stack so); refuse
    any other channel-only image saying what its metadata calls the pages and how to relabel them."""
    meta = tif.imagej_metadata or {}
    mode = str(meta.get("mode", "grayscale"))
    stacked = int(meta.get("slices", 1)) > 1 or int(meta.get("frames", 1)) > 1
    if meta and not stacked and mode == IMAGEJ_GREY:
        return
    said = (f"; its ImageJ metadata calls the {pages} pages channels (no slices), shown as {mode}" if meta else "")
    raise ConfigError(str(file), f"a 2-D image of {pages} channel pages (axes {axes}, shape {shape}), not a "
                                 f"volume{said}: if the pages are depth slices, label them so (ImageJ: Image > "
                                 f"Properties, slices={pages} channels=1; tifffile: metadata={{'axes': 'ZYX'}})")


def _page(series: tifffile.TiffPageSeries, index: int) -> tifffile.TiffPage | tifffile.TiffFrame:
    page = series.pages[index]
    if page is None:
        raise ValueError(f"page {index} of the series is missing")
    return page


def _tiff_voxel_size(tif: tifffile.TiffFile) -> VoxelSize | None:
    """``(z, y, x)`` micrometres from OME PhysicalSize or ImageJ spacing + resolution; None when not all known."""
    if tif.is_ome and tif.ome_metadata:
        return _ome_voxel_size(tif.ome_metadata)
    meta = tif.imagej_metadata
    if not meta or "spacing" not in meta:
        return None
    unit = str(meta.get("unit", ""))
    page = tif.pages.first
    tags = page.tags
    resolution_unit = TIFF_RESOLUTION_UNITS.get(int(tags["ResolutionUnit"].value)) if "ResolutionUnit" in tags \
        else None
    sizes = []
    for name in ("YResolution", "XResolution"):
        if name not in tags:
            return None
        numerator, denominator = tags[name].value
        if not numerator:
            return None
        sizes.append(_micrometres(denominator / numerator, resolution_unit or unit))
    z = _micrometres(float(meta["spacing"]), unit)
    if z is None or None in sizes:
        return None
    return z, float(sizes[0] or 0.0), float(sizes[1] or 0.0)


def _ome_voxel_size(xml: str) -> VoxelSize | None:
    """PhysicalSizeZ/Y/X (default unit µm) of the first OME Pixels element."""
    root = ElementTree.fromstring(xml)
    pixels = next((el for el in root.iter() if el.tag.rsplit("}", 1)[-1] == "Pixels"), None)
    if pixels is None:
        return None
    sizes = []
    for axis in ("Z", "Y", "X"):
        value = pixels.get(f"PhysicalSize{axis}")
        size = None if value is None else _micrometres(float(value), pixels.get(f"PhysicalSize{axis}Unit", "µm"))
        if size is None:
            return None
        sizes.append(size)
    return sizes[0], sizes[1], sizes[2]


def _nifti_image(file: Path) -> tuple[Nifti1Pair, tuple[int, ...]]:
    import nibabel
    from nibabel.nifti1 import Nifti1Pair

    image = nibabel.load(str(file))
    if not isinstance(image, Nifti1Pair):
        raise ConfigError(str(file), f"not a NIfTI volume ({type(image).__name__})")
    shape = tuple(int(n) for n in image.shape)
    if len(shape) < 3 or shape[2] == 1:
        raise ConfigError(str(file), f"a 2-D image (shape {shape}), not a volume")
    if len(shape) > 5 or (len(shape) == 5 and shape[3] != 1):
        raise ConfigError(str(file), f"shape {shape}: one volume per file (x, y, z and channels) is supported")
    return image, shape


def _nifti_scaling(image: Nifti1Pair) -> tuple[float, float] | None:
    """The header's ``(scl_slope, scl_inter)`` when they scale the stored values (None: read as stored). nibabel
    moves them from a loaded header to the image's array proxy, so they are read there."""
    proxy = image.dataobj
    slope, inter = getattr(proxy, "slope", None), getattr(proxy, "inter", None)
    if slope is None:
        slope, inter = image.header.get_slope_inter()
    if slope is None or (slope == 1 and (inter or 0) == 0):
        return None
    return float(slope), float(inter or 0)


def _nifti_dtype(image: Nifti1Pair) -> np.dtype:
    scaled = _nifti_scaling(image) is not None
    return np.dtype(np.float64) if scaled else np.dtype(image.header.get_data_dtype())


def _nifti_space(file: Path, image: Nifti1Pair, shape: tuple[int, ...]) -> tuple[ScanSpace, Orientation]:
    """The header geometry of a NIfTI of array ``shape`` (x, y, z, ...) and how it is read; ConfigError naming a
    collapsed axis."""
    space = ScanSpace.of_header(image.header, (shape[2], shape[1], shape[0]))
    try:
        return space, space.orientation
    except ValueError as err:
        raise ConfigError(str(file), f"{err}: fix the header's qform/sform (or set both codes to 0 to read the "
                                     f"voxels as stored)") from None
    return space


def _nifti_info(file: Path) -> VolumeInfo:
    image, shape = _nifti_image(file)
    space, orientation = _nifti_space(file, image, shape)
    channels = shape[-1] if len(shape) > 3 else 1
    i, j, k = space.zooms
    sizes = [_micrometres(size, space.unit) for size in orientation.read_shape((k, j, i))]
    voxel = None if None in sizes or not all(s and s > 0 for s in sizes) else \
        (float(sizes[0] or 0), float(sizes[1] or 0), float(sizes[2] or 0))
    return VolumeInfo(file, orientation.read_shape(space.grid_shape), channels, _nifti_dtype(image), voxel, space,
                      _nifti_scaling(image))


def _read_nifti(file: Path, region: Region | None, orientation: Orientation | None) -> np.ndarray:
    image, shape = _nifti_image(file)
    grid = (shape[2], shape[1], shape[0])
    orientation = orientation if orientation is not None else _nifti_space(file, image, shape)[1]
    read_shape = orientation.read_shape(grid)
    depths, rows, cols = orientation.grid_ranges(region_ranges(region, read_shape), read_shape)
    xyz = (slice(cols.start, cols.stop), slice(rows.start, rows.stop), slice(depths.start, depths.stop))
    extra = (slice(None),) * (len(shape) - 3)
    block = np.asarray(image.dataobj[xyz + extra], dtype=_nifti_dtype(image))
    block = block.reshape(len(cols), len(rows), len(depths), -1)              # x, y, z, C
    return np.ascontiguousarray(orientation.to_read(block.transpose(3, 2, 1, 0)))
