"""A training step's input as each rank provides it: the global batch, a per-chunk reader, or nothing.

``HybridEngine.train_step(images, labels)`` accepts for ``images``

* the global batch (a tensor or a tuple of tensors; every rank passes the same one), or
* a callable ``images(sample_slice, box) -> tensor`` returning the rows ``sample_slice`` of
  the global batch, cut to ``box = (r0, r1, c0, c1)`` (half-open, image pixels) on a
  spatial stage-0 rank and whole (``box=None``) on a layer-parallel stage-0 rank, or
* ``None`` on ranks that do not run stage 0,

and for ``labels`` the global labels, a callable ``labels(sample_slice)``, a :class:`ShardedMasks`
(per-pixel labels read by box), or ``None`` on ranks that do not run the last stage.
:class:`ShardedImages` is such a callable that also knows the global batch size and image size, so
no extra arguments are needed. On a spatial last stage (every stage spatial, the loss on tiles) a
rank's labels are its tile of the masks: cut from the global masks ``(N, H, W)``, or read by box.
On a volume's grid (``slice_method="DxRxC"``) the images ``(N, C, D, H, W)`` and label volumes
``(N, D, H, W)`` are global tensors, each rank cutting its 3-D tile, or readers given the tile's ``Extent``
``((d0, d1), (r0, r1), (c0, c1))`` in place of a box (a ``ShardedImages`` of ``image_size`` (D, H, W)).

Rows go to the rank's device with ``non_blocking``: a blocking copy onto a GPU waits for every kernel queued
before it (a host sync per forward); a copy from pageable memory is staged by the driver before the call
returns, and the step's end waits for the stream anyway (its loss is read), so the batch is free again then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..comm.messages import Payload, as_items, like
from ..spatial.geometry import Box, Range, TileGrid
from .handoff import input_tile

Batch = Payload | list[torch.Tensor]                 # rows of the global batch: a tensor or tensors
Extent = tuple[Range, ...]                           # a volume tile's ((d0, d1), (r0, r1), (c0, c1))
ImageReader = Callable[[slice, Box | Extent | None], Batch]   # (sample_slice, box) -> those rows, cut to box
LabelReader = Callable[[slice], Batch]               # sample_slice -> those labels
Images = Batch | ImageReader | None                  # what ``train_step`` takes for ``images``


@dataclass(frozen=True)
class ShardedImages:
    """``read(sample_slice, box)`` plus the global ``batch_size`` and ``image_size`` (h, w), or a volume's
    (d, h, w) (``box`` then the tile's ``Extent``)."""

    read: ImageReader
    batch_size: int
    image_size: tuple[int, ...]

    def __call__(self, sample_slice: slice, box: Box | Extent | None) -> Batch:
        return self.read(sample_slice, box)


class ShardedMasks(ShardedImages):
    """Per-pixel labels: ``read(sample_slice, box)`` gives rows of the masks ``(n, h, w)`` cut to ``box``
    (a spatial last stage's tile of the output; None: whole masks); ``image_size`` is the masks' (h, w)."""


Labels = Batch | LabelReader | ShardedMasks | None   # ... and for ``labels``


def _is_batch(value: object) -> bool:
    return isinstance(value, (torch.Tensor, tuple, list))


def _leading_size(value: Batch) -> int:
    return int(as_items(value)[0].shape[0])


def resolve_batch_size(images: Images, labels: Labels, batch_size: int | None) -> int:
    """The global batch size from the argument, the images or the labels; ValueError if unknown or inconsistent."""
    found: dict[str, int] = {}
    if batch_size is not None:
        found["batch_size"] = int(batch_size)
    if isinstance(images, (torch.Tensor, tuple, list)):
        found["images"] = _leading_size(images)
    elif (declared := getattr(images, "batch_size", None)) is not None:
        found["images.batch_size"] = int(declared)
    if isinstance(labels, (torch.Tensor, tuple, list)):
        found["labels"] = _leading_size(labels)
    elif isinstance(labels, ShardedMasks):
        found["labels.batch_size"] = labels.batch_size
    if not found:
        raise ValueError("train_step cannot tell the global batch size: pass batch_size=N "
                         "(or the global images/labels tensor, or a ShardedImages)")
    if len(set(found.values())) > 1:
        raise ValueError(f"inconsistent global batch sizes {found}; pass one label per image "
                         f"and the same batch_size on every rank")
    return next(iter(found.values()))


def resolve_image_size(images: Images, image_size: int | tuple[int, ...] | None) -> tuple[int, ...] | None:
    """(height, width) of the full images, or a volume's (depth, height, width), if given or known by the images
    object."""
    size = image_size if image_size is not None else getattr(images, "image_size", None)
    if size is None:
        return None
    if isinstance(size, int):
        return (size, size)
    return tuple(int(n) for n in size)


def reader_box(grid: TileGrid, tile: int, size: tuple[int, ...], argument: str) -> Box | Extent:
    """What a reader of ``argument`` gets for ``tile`` of maps of ``size``: a box, or on a volume's grid its
    ``Extent``; ValueError when ``size`` does not have the grid's axes."""
    if len(size) != grid.ndim:
        raise ValueError(f"{argument} from a reader on {grid} need a size of {grid.ndim} axes "
                         f"({'(D, H, W)' if grid.volumetric else '(H, W)'}), got {size}")
    if grid.volumetric:
        return grid.extent(tile, size)
    return grid.tile_box(tile, size[0], size[1])


@dataclass
class StepInput:
    """This rank's view of one step's data (what the runtime reads for stage 0 and the loss)."""

    images: Images
    labels: Labels
    batch_size: int
    image_size: tuple[int, ...] | None = None

    def check(self, rank: int, runs_first: bool, runs_spatial_first: bool, runs_last: bool) -> None:
        """ValueError naming the missing argument for the stages this rank runs."""
        if runs_first and self.images is None:
            raise ValueError(f"rank {rank} runs stage 0 but images is None; pass the global "
                             f"batch or a callable images(sample_slice, box)")
        if runs_first and not _is_batch(self.images) and not callable(self.images):
            raise TypeError(f"images must be a tensor, a tuple of tensors, a callable "
                            f"images(sample_slice, box) or None; got {type(self.images).__name__}")
        if runs_spatial_first and callable(self.images) and self.image_size is None:
            raise ValueError(f"rank {rank} holds a tile of stage 0 and gets images from a "
                             f"callable: pass image_size=(height, width) (or a ShardedImages) "
                             f"so the engine can compute the tile box")
        if runs_last and self.labels is None:
            raise ValueError(f"rank {rank} runs the last stage but labels is None; pass the "
                             f"global labels or a callable labels(sample_slice)")

    def images_for(self, rows: slice, tile: int | None, grid: TileGrid | None,
                   device: torch.device) -> Payload:
        """Rows ``rows`` of the images, cut to tile ``tile`` (None: whole), on ``device``."""
        if tile is not None and grid is None:
            raise ValueError(f"images of tile {tile} need the tile grid")
        images = self.images
        if tile is None and isinstance(images, torch.Tensor):   # the common case, per forward: one slice
            return images[rows].to(device, non_blocking=True)
        if isinstance(images, (torch.Tensor, tuple, list)):
            data = like(images, [t[rows].to(device, non_blocking=True) for t in as_items(images)])
            return input_tile(data, grid, tile) if tile is not None and grid is not None else data
        if images is None:
            raise ValueError("this rank has no images (None); see StepInput.check")
        box = None
        if tile is not None and grid is not None:
            if self.image_size is None:
                raise ValueError(f"tile {tile} of images from a callable needs image_size")
            box = reader_box(grid, tile, self.image_size, "images")
        read = images(rows, box)
        return like(read, [t.to(device, non_blocking=True) for t in as_items(read)])

    def labels_for(self, rows: slice, device: torch.device, tile: int | None = None,
                   grid: TileGrid | None = None) -> Payload:
        """Rows ``rows`` of the labels on ``device``; on a spatial last stage (``tile``) that tile of the masks."""
        labels = self.labels
        if tile is None and isinstance(labels, torch.Tensor):   # the common case, per forward: one slice
            return labels[rows].to(device, non_blocking=True)
        if labels is None:
            raise ValueError("this rank has no labels (None); see StepInput.check")
        if isinstance(labels, ShardedMasks):
            data = labels(rows, reader_box(grid, tile, labels.image_size, "labels")
                          if tile is not None and grid is not None else None)
        else:
            if isinstance(labels, (torch.Tensor, tuple, list)):
                data = like(labels, [t[rows] for t in as_items(labels)])
            else:
                read = labels(rows)
                data = like(read, as_items(read))
            if tile is not None and grid is not None:
                data = input_tile(data, grid, tile, leading=1)
        return like(data, [t.to(device, non_blocking=True) for t in as_items(data)])
