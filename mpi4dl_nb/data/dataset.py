"""Dataset protocol with region reads (a spatial rank reads only its tile box) and a deterministic batcher."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeGuard, runtime_checkable

import numpy as np
import torch

from .augment import AugmentSpec, Draw
from .balanced import BalancedOrder

Box = tuple[int, int, int, int]  # half-open (r0, r1, c0, c1), as geometry.TileGrid.tile_box
VolumeBox = tuple[tuple[int, int], ...]   # a volume's half-open ((d0, d1), (r0, r1), (c0, c1)), as TileGrid.extent
AnyBox = Box | VolumeBox


@runtime_checkable
class RegionDataset(Protocol):
    """Images of ``channels x image_size x image_size`` with integer labels; any box readable alone."""

    image_size: int
    channels: int
    num_classes: int

    def __len__(self) -> int: ...

    def label(self, index: int) -> int: ...

    def read(self, index: int, box: Box | None = None) -> torch.Tensor:
        """Image ``index`` (C, H, W) float in [0, 1], only the ``box`` part when given."""
        ...


@runtime_checkable
class VolumeImages(Protocol):
    """A dataset of volumes (``volume_size`` (D, H, W) voxels): ``read`` ``(C, d, h, w)`` takes a ``VolumeBox`` (a
    spatial rank's 3-D tile)."""

    volume_size: tuple[int, int, int]

    def read(self, index: int, box: AnyBox | None = None) -> torch.Tensor: ...


@runtime_checkable
class VolumeRegions(VolumeImages, Protocol):
    """Volumes with label volumes: ``read_mask`` ``(d, h, w)`` takes a ``VolumeBox`` too."""

    def read_mask(self, index: int, box: AnyBox | None = None) -> torch.Tensor: ...


def is_volume_box(box: AnyBox | None) -> TypeGuard[VolumeBox]:
    """Whether ``box`` is a volume's ((d0, d1), (r0, r1), (c0, c1))."""
    return box is not None and len(box) > 0 and isinstance(box[0], tuple)


def is_image_box(box: AnyBox) -> TypeGuard[Box]:
    """Whether ``box`` is an image's (r0, r1, c0, c1)."""
    return len(box) == 4 and not isinstance(box[0], tuple)


def image_box(box: AnyBox | None) -> Box | None:
    """``box`` as an image's box (None: none); ValueError for a volume's."""
    if box is None:
        return None
    if is_image_box(box):
        return box
    raise ValueError(f"an image is read by a box (r0, r1, c0, c1), got {box}")


def input_size(dataset: RegionDataset) -> int | tuple[int, int, int]:
    """What a batch of ``dataset`` is cut by: a volume's ``(D, H, W)``, an image's side."""
    return dataset.volume_size if isinstance(dataset, VolumeImages) else dataset.image_size


def as_volume_images(dataset: RegionDataset, box: VolumeBox) -> VolumeImages:
    """``dataset`` as volumes, for a read of ``box``; TypeError when it is not one."""
    if not isinstance(dataset, VolumeImages):
        raise TypeError(f"{type(dataset).__name__} holds images, not volumes: it cannot read the 3-D box {box}")
    return dataset


def volume_dataset(dataset: RegionDataset, box: VolumeBox) -> VolumeRegions:
    """``dataset`` as volumes with label volumes, for a read of ``box``; TypeError when it is not one."""
    if not isinstance(dataset, VolumeRegions):
        raise TypeError(f"{type(dataset).__name__} holds no label volumes: it cannot read the 3-D box {box} of one")
    return dataset


def read_box(dataset: RegionDataset, index: int, box: AnyBox | None) -> torch.Tensor:
    """Image ``index`` of ``dataset``, only ``box`` of it (a volume's 3-D box, or an image's)."""
    if is_volume_box(box):
        return as_volume_images(dataset, box).read(index, box)
    return dataset.read(index, image_box(box))


def full_box(size: int) -> Box:
    """The box covering a whole ``size x size`` image."""
    return (0, size, 0, size)


def check_box(box: Box | None, size: int) -> Box:
    """``box`` (default: the whole image) checked to lie inside a ``size x size`` image."""
    if box is None:
        return full_box(size)
    r0, r1, c0, c1 = box
    if not (0 <= r0 < r1 <= size and 0 <= c0 < c1 <= size):
        raise ValueError(f"region {box} (r0, r1, c0, c1) is not inside a {size}x{size} image")
    return (int(r0), int(r1), int(c0), int(c1))


def to_tensor(pixels: np.ndarray) -> torch.Tensor:
    """HxWxC uint8 (or HxW) array -> CxHxW float32 tensor in [0, 1]."""
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1))).float().div_(255.0)


@dataclass(frozen=True)
class Batcher:
    """Deterministic batches: the order of epoch ``e`` is a permutation seeded by ``(seed, e)``.

    ``batch(epoch, step)`` is a pure function of its arguments, so a resumed run sees the very
    batches an uninterrupted one would. The last incomplete batch of an epoch is dropped.
    ``augment``: each image is augmented by its draw keyed by ``(seed, epoch, step, index)``
    (``data/augment.py``), a box of it read through the draw. ``balanced``: the epoch's order drawn class by class
    (``data/balanced.py``: each class equally often, within it each slide or patient in turn), as pure.
    """

    dataset: RegionDataset
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    augment: AugmentSpec | None = None
    balanced: BalancedOrder | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if len(self.dataset) < self.batch_size:
            raise ValueError(f"the dataset has {len(self.dataset)} images, fewer than one batch "
                             f"of --batch-size {self.batch_size}; use --batch-size <= "
                             f"{len(self.dataset)} or more data")

    @property
    def steps_per_epoch(self) -> int:
        return len(self.dataset) // self.batch_size

    def indices(self, epoch: int, step: int) -> list[int]:
        """Dataset indices of batch ``step`` of ``epoch``."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} outside an epoch of {self.steps_per_epoch} steps")
        if self.balanced is not None:
            return self.balanced.epoch(self.seed, epoch)[step * self.batch_size:(step + 1) * self.batch_size]
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(len(self.dataset), generator=gen)
        else:
            order = torch.arange(len(self.dataset))
        return order[step * self.batch_size:(step + 1) * self.batch_size].tolist()

    def labels(self, epoch: int, step: int) -> torch.Tensor:
        """Labels of batch ``step`` of ``epoch`` (int64)."""
        return torch.tensor([self.dataset.label(i) for i in self.indices(epoch, step)],
                            dtype=torch.long)

    def images(self, epoch: int, step: int, box: AnyBox | None = None,
               rows: Sequence[int] | None = None) -> torch.Tensor:
        """Images (N, C, h, w) of the batch, only ``box`` of each; ``rows`` picks batch entries."""
        chosen = self.indices(epoch, step)
        if rows is not None:
            chosen = [chosen[r] for r in rows]
        return torch.stack([self.read(epoch, step, i, box) for i in chosen])

    def augmentation(self, epoch: int, step: int, index: int) -> Draw | None:
        """Image ``index``'s augmentation in batch ``step`` of ``epoch`` (None: not augmented)."""
        if not self.augment:
            return None
        return self.augment.draw(self.seed, epoch, step, index)

    def read(self, epoch: int, step: int, index: int, box: AnyBox | None = None) -> torch.Tensor:
        """Image ``index`` as batch ``step`` of ``epoch`` sees it (augmented), only ``box`` of it (a volume's:
        never augmented)."""
        if is_volume_box(box):
            return read_box(self.dataset, index, box)
        draw = self.augmentation(epoch, step, index)
        if draw is None:
            return self.dataset.read(index, image_box(box))
        size = self.dataset.image_size
        return draw.apply(self.dataset.read(index, draw.source_box(check_box(image_box(box), size), size)))
