"""VolumeEvaluator: held-out volumes through the training layout, voxels counted on the 3-D tiles, a Dice per volume."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..data.volume.dataset import VolumeFolderDataset
from ..loss import DenseLoss
from .batch_inputs import BatchInputs
from .pixel_evaluator import SegmentationEvaluator

if TYPE_CHECKING:
    from ..comm.protocol import Comm
    from ..pipeline.engine import HybridEngine


class VolumeEvaluator(SegmentationEvaluator):
    """``SegmentationEvaluator`` on a VolumeFolderDataset: each rank reads the 3-D tile it runs of every volume and
    label volume; rank 0 adds the counts, per volume too, so its metrics carry each volume's Dice and their mean."""

    per_image = True

    def __init__(self, engine: HybridEngine, dataset: VolumeFolderDataset, ctx: Comm, batch_size: int,
                 loss: DenseLoss, dtype: torch.dtype = torch.float32, classes: Sequence[str] = ()) -> None:
        super().__init__(engine, dataset, ctx, batch_size, loss, dtype, classes)
        self.volumes = dataset
        self.inputs = BatchInputs(engine, ctx.rank, dataset.volume_size, batch_size, dtype)

    def read_masks(self, positions: np.ndarray, tile: int | None) -> torch.Tensor:
        """The label volumes at ``positions``, cut to the 3-D extent of ``tile`` (None: whole)."""
        grid = self.engine.grid
        box = grid.extent(tile, self.volumes.volume_size) if tile is not None and grid is not None else None
        return torch.stack([self.volumes.read_mask(int(p), box) for p in positions])
