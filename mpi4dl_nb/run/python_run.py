"""A run set up in Python: its record from a model spec or model object and a dataset, a held-out split.

What a TrainJob records (``run/job.py``), derived here from objects, so that ``Trainer.for_data``
writes checkpoints that ``evaluate``, ``infer``, ``dl.model_state_dict`` and resume read like a
command's: the model (a ``ModelSpec``, or a model object recorded as ``python:<its class>``, which
the readers then take back as ``model=...``), the data (its kind, size and folder), the seed.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.record import DataRecord, RunRecord
from ..data.apps import AppKind
from ..data.cifar import Cifar10Dataset
from ..data.dataset import RegionDataset
from ..data.groups import given_groups, groups_of
from ..data.stain_reads import stain_of
from ..data.synthetic import SyntheticDataset
from ..evaluation.split import Subset
from ..models.spec import ModelFamily, ModelSpec
from .job_data import held_out_split

ModelObject = nn.Module | Sequence[nn.Module]


def split_dataset(dataset: RegionDataset, fraction: float, seed: int = 0, *,
                  groups: Sequence[object] | None = None, group_by: str | None = None) -> tuple[Subset, Subset]:
    """(training images, held-out images): a seeded share ``fraction`` of the groups of each class held out, as
    ``train --val-fraction F --seed S`` does (every rank gets the same split). The groups: ``groups`` (one name
    per image, e.g. its patient), else the dataset's own (a slide's tiles; tile files named after their slide,
    by ``group_by`` or the default patterns), else every image alone."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must lie strictly between 0 and 1, got {fraction:g}")
    found = given_groups(groups, len(dataset)) if groups is not None else groups_of(dataset, group_by)
    return held_out_split(dataset, fraction, seed, dataset.num_classes, found)


def base_of(dataset: RegionDataset) -> RegionDataset:
    """The dataset a Subset reads from (the dataset itself otherwise)."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return dataset


def source_of(dataset: RegionDataset) -> tuple[AppKind, str | None]:
    """The kind of data (``--app``) and its folder or file, when it has one."""
    base = base_of(dataset)
    if isinstance(base, SyntheticDataset):
        return AppKind.SYNTHETIC, None
    root = getattr(base, "root", None)
    path = str(root) if isinstance(root, (str, Path)) else None
    return (AppKind.CIFAR if isinstance(base, Cifar10Dataset) else AppKind.MEDICAL), path


def model_record(model: ModelSpec | ModelObject | str, num_classes: int) -> ModelSpec:
    """``model`` as a checkpoint records it: a spec as it is; a model object (or a name for it) as
    ``python:<its class or name>``, which the checkpoint's readers take back as ``model=``."""
    if isinstance(model, ModelSpec):
        return model
    kind = model if isinstance(model, str) else type(model).__name__ if isinstance(model, nn.Module) else "layers"
    return ModelSpec.of(f"{ModelFamily.PYTHON}:{kind}", num_classes=num_classes)


def record_for(model: ModelSpec | ModelObject | str, dataset: RegionDataset, batch_size: int, *, seed: int = 0,
               dtype: torch.dtype = torch.float32, val_fraction: float | None = None,
               validation: RegionDataset | None = None, classes: Sequence[str] | None = None) -> RunRecord:
    """The record a Python run writes into its checkpoints: model, data (``dataset`` before any split; held out
    by ``val_fraction``, or ``validation`` read from another folder), seed, the stain normaliser it reads through."""
    app, path = source_of(dataset)
    named = classes if classes is not None else getattr(base_of(dataset), "classes", None)
    data = DataRecord(app, dataset.image_size, batch_size, dtype=str(dtype).removeprefix("torch."), datapath=path,
                      val_fraction=val_fraction, val_datapath=None if validation is None else source_of(validation)[1],
                      classes=tuple(named) if named else None)
    return RunRecord(model_record(model, dataset.num_classes), data, seed=seed, stain=stain_of(base_of(dataset)))
