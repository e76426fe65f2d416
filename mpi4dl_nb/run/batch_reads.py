"""This rank's reads of a training batch: its images and masks by the rows and tile box the engine asks for, and its
labels; read when the engine asks, or all before the step (read ahead); the seconds the steps waited for them."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from ..data import Batcher
from ..data.masks import batch_masks
from ..evaluation.batch_inputs import BatchInputs, Read
from ..pipeline.step_input import Batch, Extent, ShardedImages, ShardedMasks
from ..spatial.geometry import Box

Position = tuple[int, int]                         # a batch's (epoch, batch in the epoch)
ReadKey = tuple[int, int, Box | Extent | None]     # one read the engine makes: (first row, end row, tile box)
StepBatch = tuple[ShardedImages | None, torch.Tensor | ShardedMasks | None]   # one batch as train_step takes it
Sharded = TypeVar("Sharded", bound=ShardedImages)
T = TypeVar("T")


def read_key(rows: slice, box: Box | Extent | None) -> ReadKey:
    """The key of the read of ``rows`` cut to ``box``."""
    return (int(rows.start or 0), int(rows.stop), box)


@dataclass(frozen=True)
class BatchRead:
    """A batch read before its step: where it is, its labels (None: masks, read by box) and every read of it the
    engine makes of this rank, by key (each taken once)."""

    position: Position
    labels: torch.Tensor | None
    images: dict[ReadKey, Batch]
    masks: dict[ReadKey, Batch]


def every_read(reader: ShardedImages | None, reads: tuple[Read, ...]) -> dict[ReadKey, Batch]:
    """Each of ``reads`` made of ``reader`` now (none without a reader)."""
    return {} if reader is None else {read_key(rows, box): reader(rows, box) for rows, box in reads}


class BatchReads:
    """This rank's reads of ``batcher``'s batches through ``inputs`` (``dense``: masks read by box, no labels).

    ``ahead(position)`` makes every read a training step's engine makes of this rank for that batch (on the
    read-ahead worker); ``batch(position, ready)`` gives the engine the batch, served from ``ready`` and anything
    else read when asked. The main thread's time reading (and waiting, ``timed``) adds up in ``wait_seconds``;
    ``misses`` counts reads the engine made of a batch read ahead that were not among its reads.
    """

    def __init__(self, batcher: Batcher, inputs: BatchInputs, dense: bool) -> None:
        self.batcher = batcher
        self.inputs = inputs
        self.dense = dense
        self.image_reads = inputs.image_reads()
        self.mask_reads = inputs.mask_reads()
        self.wait_seconds = 0.0
        self.misses = 0

    def readers(self, position: Position) -> tuple[ShardedImages | None, ShardedMasks | None]:
        """The readers of ``position``'s images and masks as this rank reads them (None: it reads none)."""
        epoch, step = position
        batcher = self.batcher
        images = self.inputs.images(lambda rows, box: batcher.images(epoch, step, box, rows))
        masks = self.inputs.masks(lambda rows, box: batch_masks(batcher, epoch, step, box, rows))
        return images, masks

    def labels(self, position: Position) -> torch.Tensor | None:
        """The labels of ``position``'s batch (None: a dense model's, masks read by box)."""
        return None if self.dense else self.batcher.labels(*position)

    def ahead(self, position: Position) -> BatchRead:
        """Every read of ``position``'s batch the engine will make of this rank, made now."""
        images, masks = self.readers(position)
        return BatchRead(position, self.labels(position), every_read(images, self.image_reads),
                         every_read(masks, self.mask_reads))

    def batch(self, position: Position, ready: BatchRead | None = None) -> StepBatch:
        """``position``'s batch as the engine takes it: what ``ready`` read ahead (when it is that batch's), the
        rest read when the engine asks for it."""
        read = ready if ready is not None and ready.position == position else None
        images, masks = self.readers(position)
        served = self.served(images, None if read is None else read.images)
        if self.dense:
            return served, self.served(masks, None if read is None else read.masks)
        return served, read.labels if read is not None else self.timed(self.labels, position)

    def served(self, reader: Sharded | None, ready: dict[ReadKey, Batch] | None) -> Sharded | None:
        """``reader`` giving the reads in ``ready`` (each once, then dropped) and reading any other when asked."""
        if reader is None:
            return None

        def read(rows: slice, box: Box | Extent | None) -> Batch:
            found = ready.pop(read_key(rows, box), None) if ready is not None else None
            if found is not None:
                return found
            if ready is not None:
                self.misses += 1
            return self.timed(reader.read, rows, box)
        return replace(reader, read=read)

    def timed(self, read: Callable[..., T], *args: object) -> T:
        """``read(*args)``, its seconds added to ``wait_seconds``."""
        start = time.perf_counter()
        try:
            return read(*args)
        finally:
            self.wait_seconds += time.perf_counter() - start
