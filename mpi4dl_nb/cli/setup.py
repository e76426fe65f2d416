"""Set-up steps the ``train`` and ``evaluate`` commands share: flags to a checked layout, model fit, dataset."""
from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ConfigError, ParallelConfig
from .args import config_from_args

if TYPE_CHECKING:
    from torch import nn

    from ..data.dataset import RegionDataset


def parse_launch(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                 check: Callable[[argparse.Namespace], None]) -> tuple[argparse.Namespace, ParallelConfig]:
    """The flags and their layout, refused (exit 2, rank 0 says why) on a ConfigError of ``check`` or a rank
    count that does not match; every rank decides alone, before any communication."""
    from .layout_cmd import check_world_size, launched_world, refuse

    args = parser.parse_args(argv)
    rank, size, _ = launched_world()
    try:
        cfg = config_from_args(args)
        check(args)
    except ConfigError as err:
        refuse(str(err), rank, size)
    check_world_size(cfg, size, rank)
    return args, cfg


def check_layout(cfg: ParallelConfig, layers: Sequence[nn.Module], batch_size: int, image_size: int) -> None:
    """ConfigError unless ``cfg`` fits this model, batch and image: stage count, batch split, spatial halos."""
    from ..run.trainer import check_spatial_geometry

    cfg.validate(batch_size=batch_size, num_layers=len(layers), image_size=image_size)
    check_spatial_geometry(layers, cfg, image_size)


def dataset_from(args: argparse.Namespace, datapath: str | Path | None, exclude: Sequence[Path] = ()) -> RegionDataset:
    """The dataset the data flags in ``args`` name, read from ``datapath`` (without the files ``exclude``; class
    folders labelled in the order of ``args.class_order`` when set)."""
    from ..data import make_dataset
    from .resolution_flags import resolution_of
    from .segmentation_flags import segmentation_dataset, task_of

    if task_of(args).dense:
        return segmentation_dataset(args, datapath, exclude)
    mpp, source_mpp = resolution_of(args)
    return make_dataset(args.app, args.image_size, args.num_classes, datapath=datapath, seed=args.seed,
                        num_samples=args.num_samples, slide_level=args.slide_level, min_tissue=args.min_tissue,
                        exclude=exclude, classes=getattr(args, "class_order", None), mpp=mpp, source_mpp=source_mpp)
