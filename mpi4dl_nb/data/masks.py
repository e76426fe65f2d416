"""Images with a class index per pixel: the MaskDataset protocol, and a folder of ``images/`` with their ``masks/``.

The folder holds ``images/<stem>.<png|jpg|tif|...>`` and ``masks/<stem>.<png|tif|tiff>`` (same stem). A mask
is one channel of integers (8-, 16- or 32-bit grey, or a palette PNG whose indices are the classes), as
large as its image; both are centre-cropped alike to ``--image-size``. ``check_pair`` is the check before
the first step: the image readable, its mask there, of an integer mode, of the image's size, and every
label a class (``0 .. num_classes - 1``) or ``ignore_index`` (``label_range_problem``, label volumes' check too).
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from .crops import NATIVE, CentreCrop
from .dataset import AnyBox, Batcher, Box, RegionDataset, check_box, image_box, is_volume_box, volume_dataset
from .files import TILE_EXTENSIONS, require_path
from .pathology import TileFolderDataset
from .resolution import LevelChoice
from .stain import StainNormalizer

MASK_EXTENSIONS = (".png", ".tif", ".tiff")
MASK_MODES = ("1", "L", "P", "I;16", "I;16L", "I;16B", "I")   # one channel of integers
IMAGES, MASKS = "images", "masks"
SHOWN_LABELS = 6


@runtime_checkable
class MaskDataset(RegionDataset, Protocol):
    """A RegionDataset whose images come with masks: ``read_mask(index, box)`` is int64 ``(h, w)``."""

    def read_mask(self, index: int, box: Box | None = None) -> torch.Tensor: ...


def is_mask_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder with ``images/`` and ``masks/`` sub-folders."""
    root = Path(path).expanduser()
    return (root / IMAGES).is_dir() and (root / MASKS).is_dir()


def image_files(root: Path) -> list[Path]:
    """The images of a mask folder, sorted."""
    return sorted(p for p in (root / IMAGES).iterdir() if p.is_file() and p.suffix.lower() in TILE_EXTENSIONS)


@functools.lru_cache(maxsize=8)
def masks_by_stem(folder: Path) -> dict[str, tuple[Path, ...]]:
    """The mask files of ``folder`` by stem (listed once per folder)."""
    found: dict[str, list[Path]] = {}
    if folder.is_dir():
        for path in sorted(folder.iterdir()):
            if path.is_file() and path.suffix.lower() in MASK_EXTENSIONS:
                found.setdefault(path.stem, []).append(path)
    return {stem: tuple(paths) for stem, paths in found.items()}


def mask_of(image: Path) -> Path:
    """The mask of ``image`` (``../masks/<stem>.<png|tif|tiff>``); ValueError when it has none, or several."""
    found = masks_by_stem(image.parent.parent / MASKS).get(image.stem, ())
    if not found:
        raise ValueError(f"no mask {MASKS}/{image.stem}{{{','.join(MASK_EXTENSIONS)}}} for {IMAGES}/{image.name}")
    if len(found) > 1:
        raise ValueError(f"{IMAGES}/{image.name} has {len(found)} masks ({', '.join(p.name for p in found)}); "
                         f"keep one")
    return found[0]


def read_mask_file(path: Path, size: int, box: Box | None = None, choice: LevelChoice = NATIVE) -> torch.Tensor:
    """The centre ``size`` crop of a mask file (``box`` of it), int64 ``(h, w)``; at ``choice``'s resolution (its
    image's) by majority label."""
    from PIL import Image

    with Image.open(path) as img:
        crop = CentreCrop(img.width, img.height, size, choice)
        pixels = crop.labels(lambda b: np.asarray(img.crop((b[2], b[0], b[3], b[1]))), box)
    return torch.from_numpy(pixels.astype(np.int64))


def check_pair(image: Path, image_size: int, num_classes: int, ignore_index: int | None) -> str | None:
    """Why ``image`` and its mask cannot be trained on (None: usable); reads the mask's every pixel."""
    from PIL import Image

    from .validate import SourceKind, check_file

    problem = check_file(image, SourceKind.TILES, image_size)
    if problem is not None:
        return problem
    try:
        mask = mask_of(image)
        with Image.open(image) as img:
            size = img.size
        with Image.open(mask) as img:
            if img.mode not in MASK_MODES:
                return (f"mask {MASKS}/{mask.name} has pixel mode {img.mode}; a mask holds one class index per "
                        f"pixel (8/16/32-bit grey or a palette PNG)")
            if img.size != size:
                return (f"mask {MASKS}/{mask.name} is {img.width}x{img.height} pixels but its image is "
                        f"{size[0]}x{size[1]}; a mask must match its image in size")
            labels = np.unique(np.asarray(img))
    except (OSError, ValueError) as err:
        return str(err)
    return label_range_problem(labels, num_classes, ignore_index, f"mask {MASKS}/{mask.name}")


def label_range_problem(labels: Iterable[int], num_classes: int, ignore_index: int | None,
                        what: str) -> str | None:
    """Why the labels found in ``what`` (a mask or a label volume, as the message names it) cannot be trained on:
    the labels that are no class (``0 .. num_classes - 1``) and not ``ignore_index``, the first few shown; None
    when every label is one. The one label-range check of masks (``check_pair``) and label volumes
    (volume/dataset.py's ``check_volume_pair``)."""
    bad = sorted({int(v) for v in labels if not (0 <= v < num_classes) and v != ignore_index})
    if not bad:
        return None
    shown = ", ".join(map(str, bad[:SHOWN_LABELS])) + (", ..." if len(bad) > SHOWN_LABELS else "")
    ignore = f", --ignore-index {ignore_index}" if ignore_index is not None else ", no --ignore-index"
    return f"{what} holds label(s) {shown} outside 0..{num_classes - 1} (--num-classes {num_classes}{ignore})"


class MaskFolderDataset:
    """``root/images/*`` with ``root/masks/<same stem>``: images read like a tile folder, masks cropped alike.

    ``files`` (default: every image) gives the images to use, e.g. without bad ones. Every image has
    label 0 (held-out splits are not stratified by class: the classes are per pixel). ``mpp``/``source_mpp``:
    images read at a resolution as a tile folder reads them, each mask at its image's (majority label).
    """

    def __init__(self, root: str | Path, image_size: int, num_classes: int, *,
                 files: Sequence[Path] | None = None, mpp: float | None = None,
                 source_mpp: float | None = None) -> None:
        self.root = require_path(root)
        chosen = sorted(files) if files is not None else image_files(self.root)
        if not chosen:
            raise FileNotFoundError(f"--datapath {str(root)!r} holds no images in {IMAGES}/ "
                                    f"({', '.join(TILE_EXTENSIONS)})")
        self.images = TileFolderDataset(self.root / IMAGES, image_size, num_classes=1, files=chosen, mpp=mpp,
                                        source_mpp=source_mpp)
        self.files = self.images.files
        self.masks = [mask_of(p) for p in self.files]
        self.image_size = image_size
        self.channels = 3
        self.num_classes = num_classes

    def __len__(self) -> int:
        return len(self.files)

    def label(self, index: int) -> int:
        return 0

    def read(self, index: int, box: Box | None = None) -> torch.Tensor:
        return self.images.read(index, box)

    @property
    def stain(self) -> StainNormalizer | None:
        """The normaliser the images are read through (None: none)."""
        return self.images.stain

    def use_stain(self, normalizer: StainNormalizer | None) -> None:
        """Normalise the images' stains with ``normalizer`` (None: as stored)."""
        self.images.use_stain(normalizer)

    @property
    def mpp(self) -> float | None:
        """µm per pixel the images (and masks) are read at (None: unknown)."""
        return self.images.mpp

    def read_mask(self, index: int, box: Box | None = None) -> torch.Tensor:
        choices = self.images.choices
        return read_mask_file(self.masks[index], self.image_size, box, NATIVE if choices is None else choices[index])


def batch_masks(batcher: Batcher, epoch: int, step: int, box: AnyBox | None = None,
                rows: Sequence[int] | None = None) -> torch.Tensor:
    """Masks ``(n, h, w)`` of batch ``step`` of ``epoch`` (entries ``rows``), only ``box`` of each, flipped and turned
    as the batch's images are (``--augment``: the geometric part of each image's draw; colours leave masks alone)."""
    dataset = batcher.dataset
    if not isinstance(dataset, MaskDataset):
        raise TypeError(f"{type(dataset).__name__} has no masks (read_mask); segmentation needs a MaskDataset")
    chosen = batcher.indices(epoch, step)
    if rows is not None:
        chosen = [chosen[r] for r in rows]
    size = dataset.image_size
    masks = []
    for index in chosen:
        if is_volume_box(box):                     # a volume's tile (volumes are not augmented)
            masks.append(volume_dataset(dataset, box).read_mask(index, box))
            continue
        draw = batcher.augmentation(epoch, step, index)
        if draw is None:
            masks.append(dataset.read_mask(index, image_box(box)))
        else:
            masks.append(draw.place(dataset.read_mask(index, draw.source_box(check_box(image_box(box), size), size))))
    return torch.stack(masks)


def pixel_counts(dataset: MaskDataset, num_classes: int, ignore_index: int | None = None) -> list[int]:
    """Pixels of each class over every mask of ``dataset`` (ignored pixels left out): what ``--class-weights
    balanced`` weighs segmentation classes by. Reads every mask once."""
    counts = np.zeros(num_classes, dtype=np.int64)
    for index in range(len(dataset)):
        labels = dataset.read_mask(index).numpy().reshape(-1)
        if ignore_index is not None:
            labels = labels[labels != ignore_index]
        counts += np.bincount(labels, minlength=num_classes)[:num_classes]
    return counts.tolist()
