"""``dl.evaluate``: a checkpoint's network (or a model object and its checkpoint) on a dataset, any layout, in Python.

The same measurement as the ``evaluate`` command: every image once, forward only, with the layout of
``config``, scored with the run's loss, exact sums across ranks (``evaluation/evaluator.py``); the checkpoint's
network rebuilt from its record, or the model object a run built in Python (``model=``).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import ParallelConfig
from ..data.dataset import RegionDataset
from ..evaluation.evaluator import Evaluator
from ..evaluation.metrics import Metrics
from ..infer.model import load_trained
from ..spatial.loss import ClassCrossEntropy

if TYPE_CHECKING:
    from ..comm.protocol import Comm


def evaluate(checkpoint: str | Path, dataset: RegionDataset, *, ctx: Comm | None = None,
             config: ParallelConfig | None = None, batch_size: int | None = None,
             model: nn.Module | Sequence[nn.Module] | None = None, dtype: torch.dtype | None = None) -> Metrics:
    """The metrics of ``checkpoint`` (a file, or a directory: its newest) on every image of ``dataset``.

    Collective: every rank of ``ctx`` calls it (``config``'s world size; default one process,
    ``ParallelConfig(split_size=1, spatial_size=0)``). ``batch_size`` defaults to the run's (rounded up to the
    layout's chunks), ``dtype`` to the run's. ``model``: the model object of a run built in Python (an
    nn.Module or its layer list), which no recorded spec rebuilds. Every rank returns the same Metrics.
    """
    from ..pipeline.engine import HybridEngine

    if ctx is None:
        from ..comm.context import init

        ctx = init()
    cfg = config if config is not None else ParallelConfig(split_size=1, spatial_size=0)
    layers, _, record = load_trained(checkpoint, dtype=dtype or torch.float32, check=ctx.rank == 0, model=model)
    run_dtype = dtype or getattr(torch, record.data.dtype)
    for layer in layers:
        layer.to(run_dtype)
    batch = batch_size or record.data.batch_size
    batch = -(-batch // cfg.batch_divisor) * cfg.batch_divisor
    loss = record.loss()     # the run's: val_loss as training reported it (its class weights included)
    if not isinstance(loss, ClassCrossEntropy):
        raise ValueError(f"{checkpoint} holds a segmentation model; evaluate it with 'python -m mpi4dl_nb evaluate "
                         f"--checkpoint {checkpoint}' (pixel metrics)")
    engine = HybridEngine(layers, cfg, ctx, loss_fn=loss, image_size=dataset.image_size)
    return Evaluator(engine, dataset, ctx, batch, run_dtype, classes=record.class_names, loss=loss).run()
