"""SegmentationEvaluator: every held-out image once through the training layout, pixels counted on the tiles.

The held-out batches run forward only with the engine's layout (``engine.evaluate_tiles``). A rank
with last-stage outputs reads the mask of exactly what it predicted — its tile box of each image on a
spatial last stage, whole masks otherwise — and counts: the confusion matrix of its pixels (integers)
and, per image, the sums the run's loss is made of. Rank 0 adds every rank's counts (an image's tiles
on several ranks add up to the image), computes the loss once from the totals, and the metrics of
``pixel_metrics``; every rank gets them.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..comm.messages import as_items
from ..data.masks import MaskDataset
from ..loss import DenseLoss, PixelSums
from ..pipeline.runtime import StageOutput
from .evaluator import HeldOutBatches
from .pixel_metrics import PixelRecords, SegmentationMetrics, confusion_counts, merge_pixels, summarize_pixels

if TYPE_CHECKING:
    from ..comm.protocol import Comm
    from ..pipeline.engine import HybridEngine


class SegmentationEvaluator(HeldOutBatches):
    """Evaluates ``engine`` on a MaskDataset with the run's ``loss`` (its class weights and ignore index)."""

    def __init__(self, engine: HybridEngine, dataset: MaskDataset, ctx: Comm, batch_size: int, loss: DenseLoss,
                 dtype: torch.dtype = torch.float32, classes: Sequence[str] = ()) -> None:
        super().__init__(engine, dataset, ctx, batch_size, dtype, classes)
        self.masks = dataset
        self.loss = loss

    per_image = False      # count each image's own confusion matrix too (volumes: a Dice per volume)

    def read_masks(self, positions: np.ndarray, tile: int | None) -> torch.Tensor:
        """The masks of the images at ``positions``, cut to what a last-stage output of ``tile`` predicted (None:
        whole)."""
        size, grid = self.dataset.image_size, self.engine.grid
        box = grid.tile_box(tile, size, size) if tile is not None and grid is not None else None
        return torch.stack([self.masks.read_mask(int(p), box) for p in positions])

    def _counted(self, output: StageOutput, first: int) -> PixelRecords | None:
        """The records of one last-stage output (its real rows; None when all are filler)."""
        items = as_items(output.output)
        if len(items) != 1 or items[0].dim() != 2 + len(self.inputs.size):
            raise ValueError("a segmentation model's last layer must return the logits alone, (N, classes, "
                             f"{', '.join('DHW'[-len(self.inputs.size):])})")
        logits = items[0].detach().to("cpu", torch.float64)
        position = np.arange(first + output.rows.start, first + output.rows.stop)
        keep = position < len(self.dataset)
        if not keep.any():
            return None
        masks = self.read_masks(position[keep], output.tile)
        kept = logits[torch.from_numpy(keep)]
        sums = self.loss.sums(kept, masks)
        predicted = kept.argmax(dim=1).numpy()
        per_image = np.stack([confusion_counts(m, p, self.num_classes, self.loss.ignore_index)
                              for m, p in zip(masks.numpy(), predicted, strict=True)]) if self.per_image else None
        confusion = per_image.sum(axis=0) if per_image is not None else \
            confusion_counts(masks.numpy(), predicted, self.num_classes, self.loss.ignore_index)
        return PixelRecords(position[keep].astype(np.int64), sums.nll.numpy(), sums.weight.numpy(),
                            sums.overlap.numpy(), sums.size.numpy(), confusion, per_image)

    def local_records(self) -> PixelRecords:
        """This rank's counts over every last-stage output it computes (collective: every rank runs the batches)."""
        parts = []
        for batch in self.each_batch():
            first = batch * self.batch_size
            for output in self.engine.evaluate_tiles(self.images(batch), batch_size=self.batch_size):
                counted = self._counted(output, first)
                if counted is not None:
                    parts.append(counted)
        return merge_pixels(parts, self.num_classes)

    def run(self) -> SegmentationMetrics:
        """The metrics of the whole held-out set, on every rank (collective)."""
        gathered = self.ctx.gather_object(self.local_records(), root=0)
        result = None
        if gathered is not None:
            merged = merge_pixels(gathered, self.num_classes)
            if len(merged) != len(self.dataset):
                raise RuntimeError(f"evaluation saw {len(merged)} of {len(self.dataset)} images")
            sums = PixelSums(*(torch.from_numpy(a) for a in (merged.nll, merged.weight, merged.overlap, merged.size)))
            value = float(self.loss.value(sums))     # NaN when every held-out pixel is ignored
            result = summarize_pixels(merged, value if math.isfinite(value) else None, self.num_classes, self.classes)
            if self.per_image:
                result = result.with_volume_dice(merged)
        summary = self.ctx.bcast_object(result, root=0)
        assert summary is not None   # rank 0 holds every count
        return summary
