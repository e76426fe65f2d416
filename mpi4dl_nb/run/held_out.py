"""What the Python and command-line runs share of set-up: the evaluator of the held-out images, scoring with the
run's own loss, and the run id every rank agrees on."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..checkpoint.files import new_run_id
from ..checkpoint.record import RunRecord
from ..data.dataset import RegionDataset
from ..data.masks import MaskDataset
from ..data.volume.dataset import VolumeFolderDataset
from ..evaluation.aggregate import MEAN, Aggregation
from ..evaluation.evaluator import Evaluator
from ..evaluation.levels import sample_groups
from ..evaluation.pixel_evaluator import SegmentationEvaluator
from ..evaluation.volume_evaluator import VolumeEvaluator
from ..loss import ClassCrossEntropy

if TYPE_CHECKING:
    from ..comm.protocol import Comm
    from ..pipeline.engine import HybridEngine


def evaluator_for(engine: HybridEngine, dataset: RegionDataset, ctx: Comm, batch_size: int, record: RunRecord,
                  dtype: torch.dtype, group_by: str | None = None,
                  rule: Aggregation = MEAN) -> Evaluator | SegmentationEvaluator:
    """The evaluator of ``dataset`` with the loss ``record`` trains with (class weights included): images with a
    class each (at slide and patient level too when their slides are known: ``group_by``, ``rule``), or
    (segmentation) pixels counted on the tiles (volumes: voxels on the 3-D tiles, and a Dice per volume)."""
    loss = record.loss()
    if isinstance(loss, ClassCrossEntropy):
        return Evaluator(engine, dataset, ctx, batch_size, dtype, classes=record.class_names, loss=loss,
                         groups=sample_groups(dataset, group_by), rule=rule)
    if isinstance(dataset, VolumeFolderDataset):
        return VolumeEvaluator(engine, dataset, ctx, batch_size, loss, dtype, classes=record.class_names)
    if not isinstance(dataset, MaskDataset):
        raise TypeError(f"a segmentation evaluation needs images with masks, not {type(dataset).__name__}")
    return SegmentationEvaluator(engine, dataset, ctx, batch_size, loss, dtype, classes=record.class_names)


def shared_run_id(ctx: Comm, chosen: str | None = None) -> str:
    """Rank 0's run id (``chosen``, else a new one) on every rank (collective)."""
    run_id = ctx.bcast_object((chosen or new_run_id()) if ctx.rank == 0 else None, root=0)
    assert isinstance(run_id, str), "rank 0 sends its run id"
    return run_id
