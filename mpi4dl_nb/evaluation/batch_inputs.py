"""What a rank gives the engine for one batch: its tile box of the images (ranks that run stage 0), of the masks
(last-stage ranks of a dense model), nothing elsewhere; read from any source of rows (training, held-out images);
the reads a training step makes of them (what a step's input read ahead holds)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..pipeline.actions import ActionKind
from ..pipeline.step_input import Extent, ShardedImages, ShardedMasks, reader_box
from ..spatial.geometry import Box

if TYPE_CHECKING:
    from ..pipeline.engine import HybridEngine

RowReader = Callable[[list[int], Box | Extent | None], torch.Tensor]   # (rows of the batch, the box) -> those rows, cut
Read = tuple[slice, Box | Extent | None]     # one read the engine makes of a rank's reader: rows of the batch, tile box


class BatchInputs:
    """A rank's readers of a batch of ``batch_size`` images of ``image_size`` pixels (a volume's ``(D, H, W)``:
    read by the 3-D extent of the rank's tile) for ``engine``.

    A rank running stage 0 gets a ``ShardedImages``: the engine asks it for each chunk's rows cut to
    the rank's tile box, and it reads exactly that (for slides: one region read of the box per image), so
    a spatial rank never allocates a full-size image. Masks (``dense``) are read alike by the ranks that
    run the last stage (their tile box on a spatial last stage, whole masks on a layer-parallel one).
    Other ranks get None: no memory, no reads.
    """

    def __init__(self, engine: HybridEngine, rank: int, image_size: int | tuple[int, int, int], batch_size: int,
                 dtype: torch.dtype = torch.float32, dense: bool = False) -> None:
        actions = engine.schedule.actions(rank)
        last = engine.cfg.split_size - 1
        self.reads_images = any(a.kind is ActionKind.FORWARD and a.stage == 0 for a in actions)
        self.reads_masks = dense and any(a.kind is ActionKind.FORWARD and a.stage == last for a in actions)
        self.size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        self.batch_size = batch_size
        self.dtype = dtype
        self.engine, self.rank = engine, rank

    def images(self, read: RowReader) -> ShardedImages | None:
        """The images ``read`` gives, in the run's dtype, as this rank reads them (None: it runs no stage 0)."""
        if not self.reads_images:
            return None
        return ShardedImages(lambda rows, box: read(self.rows(rows), box).to(self.dtype), self.batch_size,
                             self.size)

    def masks(self, read: RowReader) -> ShardedMasks | None:
        """The masks ``read`` gives, as this rank reads them (None: it runs no last stage, or the model is not
        dense)."""
        if not self.reads_masks:
            return None
        return ShardedMasks(lambda rows, box: read(self.rows(rows), box), self.batch_size,
                            self.size)

    def image_reads(self) -> tuple[Read, ...]:
        """The reads of images a training step makes of this rank (none: it runs no stage 0)."""
        return step_reads(self.engine, self.rank, 0, self.batch_size, self.size) if self.reads_images else ()

    def mask_reads(self) -> tuple[Read, ...]:
        """The reads of masks a training step makes of this rank (none: it runs no last stage, or no dense one)."""
        last = self.engine.cfg.split_size - 1
        return step_reads(self.engine, self.rank, last, self.batch_size, self.size) if self.reads_masks else ()

    def rows(self, chunk: slice) -> list[int]:
        """The batch rows of a chunk."""
        return list(range(*chunk.indices(self.batch_size)))


def step_reads(engine: HybridEngine, rank: int, stage: int, batch_size: int, size: tuple[int, ...]) -> tuple[Read, ...]:
    """The reads a training step of ``engine`` makes of ``rank``'s reader for ``stage`` (0: images, the last: masks),
    as its runtime makes them (``pipeline/runtime.py``): each forward of the stage reads its chunk's rows cut to the
    rank's tile box; with ``sync_batchnorm`` a spatial stage's local-DP copies read their chunks as one, at copy 0."""
    cfg, grid = engine.cfg, engine.grid
    chunk = batch_size // cfg.batch_divisor
    together = cfg.local_dp if cfg.sync_batchnorm and stage < cfg.spatial_size and cfg.local_dp > 1 else 1
    return tuple((slice(a.chunk * chunk, (a.chunk + together) * chunk),
                  reader_box(grid, a.tile, size, "images") if a.tile is not None and grid is not None else None)
                 for a in engine.schedule.actions(rank)
                 if a.kind is ActionKind.FORWARD and a.stage == stage and (together == 1 or a.copy == 0))
