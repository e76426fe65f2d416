"""``python -m mpi4dl_nb evaluate``: a trained checkpoint on held-out data, with any rank layout, one JSON line."""
from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..checkpoint.files import BestMark
from ..checkpoint.record import RunRecord
from ..config import ConfigError, ParallelConfig
from ..data.classes import folder_classes, label_order
from ..evaluation.metrics import Metrics
from ..evaluation.pixel_metrics import SegmentationMetrics
from .args import add_parallel_args, add_workload_args
from .checkpoint_flags import add_checkpoint_flags, chosen_checkpoint
from .device_flags import add_device_flags, check_device_flags
from .model_flags import model_arg
from .parser import CommandParser, DefaultsHelpFormatter
from .resolution_flags import add_resolution_flags, check_resolution_flags, checkpoint_resolution
from .segmentation_flags import add_task_args, check_checkpoint_task, dense_loss
from .train_cmd import (
    DTYPES,
    add_evaluation_args,
    agreed,
    check_evaluation_args,
    check_numbers,
    held_out_data,
)

if TYPE_CHECKING:
    from torch import nn

    from ..comm.protocol import Comm
    from ..data.dataset import RegionDataset
    from ..infer.model import ModelDescription

# flag, ModelSpec field, attribute: a flag given on the command line must match the checkpoint's model
# (--model itself is checked by infer.model.load_trained, which knows named models such as torchvision:resnet50)
MODEL_FLAGS = (("--resnet-version", "resnet_version", "resnet_version"),
               ("--num-layers", "num_layers", "num_layers"), ("--num-filters", "num_filters", "num_filters"),
               ("--num-classes", "num_classes", "num_classes"))


@dataclass(frozen=True)
class EvaluationSummary:
    """``evaluate``'s result on rank 0: which checkpoint on which images, with which layout, and the metrics."""

    checkpoint: str
    step: int
    model: str
    split: str
    app: str
    image_size: int
    batch_size: int
    dtype: str
    world_size: int
    metrics: Metrics | SegmentationMetrics
    seconds: float
    config: Mapping[str, object] = field(default_factory=dict)
    selected: str = "latest"                # --checkpoint-select
    best: BestMark | None = None            # what a best checkpoint is best at

    def as_dict(self) -> dict[str, object]:
        chosen = {"checkpoint_select": self.selected, **({"best": self.best.to_dict()} if self.best else {})}
        return {"checkpoint": self.checkpoint, **chosen, "step": self.step, "model": self.model, "split": self.split,
                "app": self.app, "image_size": self.image_size, "batch_size": self.batch_size, "dtype": self.dtype,
                "world_size": self.world_size, **self.metrics.as_dict(), "seconds": self.seconds,
                "config": dict(self.config)}

    def to_json(self) -> str:
        """The command's one JSON line."""
        return json.dumps(self.as_dict())


def build_parser() -> argparse.ArgumentParser:
    """The ``evaluate`` parser: checkpoint, data, held-out split and parallelism flags (model from the checkpoint)."""
    parser = CommandParser(
        prog="python -m mpi4dl_nb evaluate",
        description="Evaluate a checkpoint written by 'train --checkpoint-dir' on its held-out images "
                    "(the training run's --val-fraction split, or --val-datapath) with any rank layout; "
                    "prints one JSON line of metrics. Model, image size, data and split default to the "
                    "checkpoint's.",
        formatter_class=DefaultsHelpFormatter)
    add_checkpoint_flags(parser)
    parser.add_argument("--model", type=model_arg, default=None, metavar="MODEL",
                        help="refuse the checkpoint unless it holds this network (resnet, torchvision:resnet50, ...); "
                             "the checkpoint names the network it holds")
    parser.add_argument("--resnet-version", dest="resnet_version", type=int, choices=(1, 2), default=None)
    add_parallel_args(parser)
    add_workload_args(parser)
    parser.add_argument("--seed", type=int, default=None, help="seed of the --val-fraction split "
                        "(default: the checkpoint's)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default: the checkpoint's")
    parser.add_argument("--num-samples", dest="num_samples", type=int, default=256,
                        help="images in the synthetic dataset")
    parser.add_argument("--slide-level", dest="slide_level", type=int, default=None,
                        help="pyramid level to read as it is (default: chosen by resolution; not with --mpp)")
    add_resolution_flags(parser, "default: the checkpoint's training MPP when it records one")
    parser.add_argument("--min-tissue", dest="min_tissue", type=float, default=0.5)
    add_device_flags(parser)
    parser.add_argument("--all-data", dest="all_data", action="store_true",
                        help="evaluate every image of the data, not only the held-out ones")
    add_evaluation_args(parser, training=False)
    add_task_args(parser, training=False)
    parser.set_defaults(image_size=None, batch_size=None, num_classes=None, app=None, num_epochs=1)
    return parser


def check_model_flags(args: argparse.Namespace, record: RunRecord, where: str) -> None:
    """ConfigError when a model flag given names another model than the checkpoint's."""
    saved = record.model.to_dict()
    for flag, key, attribute in MODEL_FLAGS:
        wanted = getattr(args, attribute, None)
        if wanted is not None and saved.get(key) is not None and wanted != saved[key]:
            raise ConfigError(flag, f"{where} holds a checkpoint of another model ({key} {saved[key]!r}, "
                              f"not {wanted!r}); drop {flag} or pass a checkpoint of that model")


def resolved(args: argparse.Namespace, record: RunRecord, cfg: ParallelConfig) -> argparse.Namespace:
    """``args`` with every unset data flag taken from the checkpoint's record."""
    data = record.data
    out = argparse.Namespace(**vars(args))
    out.app = args.app or data.app
    out.image_size = args.image_size or data.image_size
    out.num_classes = record.model.num_classes
    # the training run's class names order the labels of class folders (masks carry their labels as values)
    out.class_order = None if record.task.dense else label_order(folder_classes(out.app, args.datapath),
                                                                 record.data.classes)
    out.task = str(record.task)
    out.ignore_index = record.segmentation.ignore_index if record.segmentation is not None else None
    out.dtype = args.dtype or data.dtype
    out.mpp, out.slide_level = checkpoint_resolution(args, data.mpp)      # the training resolution by default
    out.magnification = None
    out.seed = args.seed if args.seed is not None else record.seed
    if args.val_datapath is None and args.val_fraction is None and not args.all_data:
        out.val_fraction = data.val_fraction
        out.val_datapath = data.val_datapath
    if args.all_data:
        out.val_fraction = out.val_datapath = None
    batch = args.batch_size or data.batch_size
    out.batch_size = -(-batch // cfg.batch_divisor) * cfg.batch_divisor
    return out


class Evaluation:
    """Set-up of ``evaluate`` in agreed stages (every rank the same verdict), then the run."""

    def __init__(self, args: argparse.Namespace, cfg: ParallelConfig, ctx: Comm) -> None:
        self.args, self.cfg, self.ctx = args, cfg, ctx
        self.layers: list[nn.Module] = []
        self.record: RunRecord | None = None
        self.description: ModelDescription | None = None
        self.settings = args
        self.dataset: RegionDataset | None = None
        self.split = "all"

    def load(self) -> None:
        """The checkpoint's network (refused if another model than the flags name) and data settings."""
        import torch

        from ..infer.model import load_trained
        from .setup import check_layout

        dtype = getattr(torch, self.args.dtype) if self.args.dtype else None
        # rank 0 checksums the file; a damaged one stops every rank in this agreed stage. Without --dtype the
        # layers come in float64 (which holds either dtype exactly) and go to the checkpoint's dtype below
        self.layers, self.description, self.record = load_trained(self.args.checkpoint, self.args.model,
                                                                  dtype or torch.float64, check=self.ctx.rank == 0)
        check_model_flags(self.args, self.record, f"--checkpoint {self.description.path}")
        check_checkpoint_task(self.args, self.record, f"--checkpoint {self.description.path}")
        self.settings = resolved(self.args, self.record, self.cfg)
        if dtype is None:
            for layer in self.layers:
                layer.to(getattr(torch, self.settings.dtype))
        check_layout(self.cfg, self.layers, self.settings.batch_size, self.settings.image_size)

    def open_data(self) -> None:
        """The images to evaluate: the training run's held-out split (checked to be the same), or all."""
        from .setup import dataset_from

        s = self.settings
        dataset = dataset_from(s, s.datapath)
        if dataset.num_classes > s.num_classes:
            raise ConfigError("--datapath", f"the data has {dataset.num_classes} classes, the checkpoint's "
                              f"model {s.num_classes}: a checkpoint of another model, or other data")
        _, held, self.split = held_out_data(s, dataset)
        assert self.record is not None, "load() read the record"
        saved = self.record.identity.get("val_split")
        explicit = self.args.val_fraction is not None or self.args.val_datapath is not None or self.args.all_data
        if held is not None and saved not in (None, "none") and saved != self.split and not explicit:
            raise ConfigError("--datapath", f"the held-out images differ from the training run's "
                              f"({self.split!r}, trained with {saved!r}): give the same --app/--datapath/--num-samples/"
                              f"--image-size as the training run, or --val-fraction/--val-datapath/--all-data "
                              f"to evaluate other images on purpose")
        self.dataset = held if held is not None else dataset

    def run(self) -> EvaluationSummary | None:
        """Evaluate (collective); the summary on rank 0."""
        import time

        import torch
        from torch import nn

        from ..evaluation.evaluator import Evaluator
        from ..pipeline.engine import HybridEngine

        assert self.description is not None and self.dataset is not None, "load() and open_data() ran"
        s = self.settings
        assert self.record is not None, "load() read the record"
        dense = self.record.task.dense
        engine = HybridEngine(self.layers, self.cfg, self.ctx, image_size=s.image_size,
                              loss_fn=dense_loss(self.record) if dense else nn.CrossEntropyLoss())
        start = time.perf_counter()
        metrics: Metrics | SegmentationMetrics
        if dense:
            from .segmentation_flags import evaluator

            metrics = evaluator(engine, self.dataset, self.ctx, s.batch_size, self.record,
                                getattr(torch, s.dtype)).run()
        else:
            metrics = Evaluator(engine, self.dataset, self.ctx, s.batch_size, getattr(torch, s.dtype),
                                classes=self.record.class_names).run()
        if self.ctx.rank != 0:
            return None
        assert self.record is not None, "load() read the record"
        return EvaluationSummary(self.description.path, self.description.step, self.description.describe(),
                                 self.split, str(s.app), s.image_size, s.batch_size, s.dtype, self.ctx.world_size,
                                 metrics, time.perf_counter() - start, self.cfg.as_dict(), self.args.checkpoint_select,
                                 self.record.best if self.args.checkpoint_select == "best" else None)


def run_evaluation(args: argparse.Namespace, cfg: ParallelConfig, ctx: Comm) -> int:
    evaluation = Evaluation(args, cfg, ctx)
    agreed(ctx, evaluation.load, "evaluate")
    agreed(ctx, evaluation.open_data, "evaluate")
    summary = evaluation.run()
    if summary is not None:
        print(summary.to_json(), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m mpi4dl_nb evaluate``."""
    from ..comm.context import init
    from .setup import parse_launch

    args, cfg = parse_launch(build_parser(), argv, check_flags)
    return run_evaluation(args, cfg, init(backend=args.backend, device=args.device))


def check_flags(args: argparse.Namespace) -> None:
    """Errors in the checkpoint, numeric, held-out data and device flags, naming the flag (before any rank talks);
    ``args.checkpoint`` becomes the file chosen."""
    check_numbers(args)
    check_evaluation_args(args)
    check_device_flags(args)
    check_resolution_flags(args)
    args.checkpoint = chosen_checkpoint(args)
