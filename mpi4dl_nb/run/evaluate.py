"""``dl.evaluate``: a checkpoint's network (or a model object and its checkpoint) on a dataset, any layout, in Python;
without a dataset, the ``evaluate`` command's job from keywords named like its flags.

The same measurement as the ``evaluate`` command: every image once, forward only, with the layout of
``config``, scored with the run's loss, exact sums across ranks (``evaluation/evaluator.py``); the checkpoint's
network rebuilt from its record, or the model object a run built in Python (``model=``); the images read through
the stain normaliser the checkpoint records, as the run read them (``stain_normalize=False``: as stored).
"""
from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, overload

import torch
from torch import nn

from ..config import ParallelConfig
from ..data.dataset import RegionDataset
from ..data.stain import StainNormalizer
from ..data.stain_reads import StainAware
from ..evaluation.evaluator import Evaluator
from ..evaluation.metrics import Metrics
from ..infer.model import load_trained
from ..infer.recorded_stain import PYTHON_KNOBS, StainChoice, refusing_broken_stain
from ..loss import ClassCrossEntropy
from ..schema import flag_fields

if TYPE_CHECKING:
    from ..comm.protocol import Comm
    from .evaluation_summary import EvaluationSummary

ONE_PROCESS = ParallelConfig(split_size=1, spatial_size=0)     # dl.evaluate's layout unless given
PARALLEL_KEYWORDS = tuple(item.flag.dest for item in flag_fields(ParallelConfig))


@overload
def evaluate(checkpoint: str | Path, dataset: RegionDataset, *, ctx: Comm | None = None,
             config: ParallelConfig | None = None, batch_size: int | None = None,
             model: nn.Module | Sequence[nn.Module] | None = None, dtype: torch.dtype | None = None,
             stain_normalize: bool = True) -> Metrics: ...


@overload
def evaluate(checkpoint: str | Path, dataset: None = None, *, ctx: Comm | None = None,
             config: ParallelConfig | None = None, **flags: object) -> EvaluationSummary | None: ...


def evaluate(checkpoint: str | Path, dataset: RegionDataset | None = None, *, ctx: Comm | None = None,
             config: ParallelConfig | None = None, **options: object) -> Metrics | EvaluationSummary | None:
    """The metrics of ``checkpoint`` (a file, or a directory: its newest) on every image of ``dataset``
    (``evaluate_dataset``); without ``dataset``, what ``python -m mpi4dl_nb evaluate`` reports for the keywords,
    named like its flags (``app="medical", datapath="tiles", val_fraction=0.25``; ``config`` the layout, else its
    parallelism keywords, else one process): the EvaluationSummary on rank 0, None elsewhere (collective)."""
    if dataset is not None:
        return evaluate_dataset(checkpoint, dataset, ctx=ctx, config=config, **options)  # type: ignore[arg-type]
    from .evaluate_job import EvaluateJob
    from .evaluate_run import run_evaluation

    job = EvaluateJob.of(checkpoint=checkpoint, **options)
    given = config or (job.config if any(name in options for name in PARALLEL_KEYWORDS) else ONE_PROCESS)
    plan = replace(job, config=given).check()
    if ctx is None:
        from ..comm.context import init

        ctx = init(backend=job.placement.backend, device=job.placement.device)
    given.validate(world_size=ctx.world_size)
    return run_evaluation(plan, ctx)


def evaluate_dataset(checkpoint: str | Path, dataset: RegionDataset, *, ctx: Comm | None = None,
                     config: ParallelConfig | None = None, batch_size: int | None = None,
                     model: nn.Module | Sequence[nn.Module] | None = None, dtype: torch.dtype | None = None,
                     stain_normalize: bool = True) -> Metrics:
    """The metrics of ``checkpoint`` (a file, or a directory: its newest) on every image of ``dataset``.

    Collective: every rank of ``ctx`` calls it (``config``'s world size; default one process,
    ``ParallelConfig(split_size=1, spatial_size=0)``). ``batch_size`` defaults to the run's (rounded up to the
    layout's chunks), ``dtype`` to the run's. ``model``: the model object of a run built in Python (an
    nn.Module or its layer list), which no recorded spec rebuilds. Every rank returns the same Metrics.
    ``stain_normalize``: read ``dataset``'s images through the stain normaliser the checkpoint records (the run's
    own reads), said once on rank 0; False reads them as stored. ``dataset`` reads as before once this returns.
    """
    from ..pipeline.engine import HybridEngine

    if ctx is None:
        from ..comm.context import init

        ctx = init()
    cfg = config if config is not None else ONE_PROCESS
    # without ``dtype`` the layers come in float64 (which holds either dtype exactly), then go to the run's dtype:
    # a float64 run's weights are not rounded through float32 on the way
    layers, _, record = refusing_broken_stain(checkpoint, lambda: load_trained(
        checkpoint, dtype=dtype or torch.float64, check=ctx.rank == 0, model=model), PYTHON_KNOBS)
    run_dtype = dtype or getattr(torch, record.data.dtype)
    for layer in layers:
        layer.to(run_dtype)
    batch = batch_size or record.data.batch_size
    batch = -(-batch // cfg.batch_divisor) * cfg.batch_divisor
    loss = record.loss()     # the run's: val_loss as training reported it (its class weights included)
    if not isinstance(loss, ClassCrossEntropy):
        raise ValueError(f"{checkpoint} holds a segmentation model; evaluate it with 'python -m mpi4dl_nb evaluate "
                         f"--checkpoint {checkpoint}' (pixel metrics)")
    choice = StainChoice(record.stain, stain_normalize)
    base = stain_base(dataset, choice)
    header = choice.header(PYTHON_KNOBS)
    if header is not None and ctx.rank == 0:
        print(f"mpi4dl_nb evaluate: {header}", file=sys.stderr, flush=True)
    engine = HybridEngine(layers, cfg, ctx, loss_fn=loss, image_size=dataset.image_size)
    with reading_through(base, choice.applied):
        return Evaluator(engine, dataset, ctx, batch, run_dtype, classes=record.class_names, loss=loss).run()


def stain_base(dataset: RegionDataset, choice: StainChoice) -> StainAware | None:
    """The dataset under ``dataset``'s subsets whose reads ``choice`` sets (None: left as it is, as for a checkpoint
    that records no normaliser; ConfigError for data without stains under a normaliser)."""
    from .python_run import base_of

    if choice.recorded is None and choice.wanted:
        return None
    base = base_of(dataset)
    if isinstance(base, StainAware):
        return base
    if choice.applied is not None:
        raise choice.refuse_unstained(type(base).__name__, PYTHON_KNOBS)
    return None


@contextmanager
def reading_through(base: StainAware | None, normalizer: StainNormalizer | None) -> Iterator[None]:
    """``base`` reading through ``normalizer`` (None: as stored) inside the block, through its own again after."""
    if base is None:
        yield
        return
    own = base.stain
    base.use_stain(normalizer)
    try:
        yield
    finally:
        base.use_stain(own)
