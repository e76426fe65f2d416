"""Evaluate a HybridEngine on a dataset with the engine's own layout: padded batches, forward only, exact merge."""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..comm.messages import as_items
from ..data.dataset import RegionDataset, input_size, read_box
from ..loss import ClassCrossEntropy
from ..pipeline.step_input import ShardedImages
from .aggregate import MEAN, Aggregation
from .batch_inputs import BatchInputs
from .levels import SampleGroups
from .metrics import Metrics, Records, merge, summarize
from .progress import HeldOutProgress

if TYPE_CHECKING:
    from ..comm.protocol import Comm
    from ..pipeline.engine import HybridEngine


class HeldOutBatches:
    """Every image of ``dataset`` once, in dataset order, as batches of the engine's batch size ``batch_size``.

    Batches have any size the layout accepts; the last one is filled up with repeats of the
    first images, whose results are dropped, so every image counts exactly once whatever the
    layout. A stage-0 rank reads only its tile box of each image (``images(batch)``, ``BatchInputs``).
    ``progress``: a line after each batch (``show_progress``; none by default, as inside a training run).
    """

    def __init__(self, engine: HybridEngine, dataset: RegionDataset, ctx: Comm, batch_size: int,
                 dtype: torch.dtype = torch.float32, classes: Sequence[str] = ()) -> None:
        if len(dataset) == 0:
            raise ValueError("the validation set is empty")
        self.engine = engine
        self.dataset = dataset
        self.ctx = ctx
        self.batch_size = batch_size
        self.dtype = dtype
        self.num_classes = dataset.num_classes
        self.classes = tuple(classes)       # the class names the metrics carry (empty: none)
        self.inputs = BatchInputs(engine, ctx.rank, input_size(dataset), batch_size, dtype)
        self.progress: HeldOutProgress | None = None

    @property
    def batches(self) -> int:
        return math.ceil(len(self.dataset) / self.batch_size)

    def show_progress(self, enabled: bool) -> None:
        """Report each batch done on a progress line (``enabled``: the reporting rank; the others print nothing)."""
        self.progress = HeldOutProgress(self.batches, self.batch_size, len(self.dataset), enabled)

    def each_batch(self) -> Iterator[int]:
        """The batch indices in order, each reported on the progress line once its body ran."""
        progress = self.progress
        try:
            for batch in range(self.batches):
                yield batch
                if progress is not None:
                    progress.batch_done(batch + 1)
        finally:
            if progress is not None:
                progress.finish()

    def positions(self, batch: int) -> list[int]:
        """Dataset positions of ``batch``'s rows (past the end: the first images again, as filler)."""
        start = batch * self.batch_size
        return [(start + r) % len(self.dataset) for r in range(self.batch_size)]

    def images(self, batch: int) -> ShardedImages | None:
        """Batch ``batch``'s images as this rank reads them (None: it runs no stage-0 forward)."""
        chosen = self.positions(batch)
        return self.inputs.images(lambda rows, box: torch.stack([read_box(self.dataset, chosen[r], box) for r in rows]))


class Evaluator(HeldOutBatches):
    """Runs ``engine.evaluate_tiles`` over the held-out batches (``HeldOutBatches``): each last-stage rank keeps
    per-sample records (position, label, loss, logits; every stage spatial: tile 0 of the joined logits every tile
    holds); rank 0 merges them in sample order and computes the
    metrics from the merged set (sums of counts and losses, never averages of averages); every rank gets them.
    The loss is the run's (``loss``: its class weights included), so ``val_loss`` is what training minimises.
    """

    def __init__(self, engine: HybridEngine, dataset: RegionDataset, ctx: Comm, batch_size: int,
                 dtype: torch.dtype = torch.float32, classes: Sequence[str] = (),
                 loss: ClassCrossEntropy | None = None, groups: SampleGroups | None = None,
                 rule: Aggregation = MEAN) -> None:
        super().__init__(engine, dataset, ctx, batch_size, dtype, classes)
        self.loss = loss if loss is not None else ClassCrossEntropy()
        self.groups = groups            # each image's slide and patient: slide/patient-level figures too
        self.rule = rule                # how a slide's tiles (and a patient's slides) aggregate

    def local_records(self) -> Records:
        """This rank's records: every last-stage output it computes, real rows only (collective)."""
        parts = []
        for batch in self.each_batch():
            outputs = self.engine.evaluate_tiles(self.images(batch), batch_size=self.batch_size)
            first = batch * self.batch_size
            for rows, out in ((o.rows, o.output) for o in outputs if o.tile in (None, 0)):   # joined logits: tile 0's
                logits = as_items(out)[0].detach().to("cpu", torch.float64)
                position = np.arange(first + rows.start, first + rows.stop)
                keep = position < len(self.dataset)
                if not keep.any():
                    continue
                labels = torch.tensor([self.dataset.label(int(p)) for p in position[keep]])
                kept = logits[torch.from_numpy(keep)]
                loss = self.loss.per_sample(kept, labels)
                parts.append(Records(position[keep].astype(np.int64), labels.numpy().astype(np.int64),
                                     loss.numpy(), kept.numpy()))
        return merge(parts, self.num_classes)

    def records(self) -> Records | None:
        """Every rank's records merged in sample order, on rank 0 (None elsewhere; collective)."""
        gathered = self.ctx.gather_object(self.local_records(), root=0)
        if gathered is None:
            return None
        merged = merge(gathered, self.num_classes)
        if len(merged) != len(self.dataset):
            raise RuntimeError(f"evaluation saw {len(merged)} of {len(self.dataset)} images")
        return merged

    def run(self) -> Metrics:
        """The metrics of the whole dataset (see ``metrics.summarize``; with ``groups``, at slide and patient level
        too), on every rank (collective)."""
        records = self.records()
        result = self.summary(records) if records is not None else None
        summary = self.ctx.bcast_object(result, root=0)
        assert summary is not None   # rank 0 holds every record
        return summary

    def summary(self, records: Records) -> Metrics:
        """The metrics of the merged ``records``, with the slide and patient levels when the groups are known."""
        metrics = summarize(records, self.num_classes, self.classes)
        if self.groups is None:
            return metrics
        per_slide = self.groups.slide_predictions(records, self.rule)
        return replace(metrics, levels=self.groups.levels(per_slide, self.rule, self.num_classes))
