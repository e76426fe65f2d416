"""``python -m mpi4dl_nb evaluate``: a trained checkpoint on held-out data, with any rank layout, one JSON line."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..checkpoint.files import BestMark
from ..checkpoint.record import RunRecord
from ..comm.agreement import SetupFailed, agreed
from ..config import ConfigError, ParallelConfig
from ..data.apps import AppKind
from ..data.classes import folder_classes, label_order
from ..data.task import Task
from ..evaluation.aggregate import Aggregation
from ..evaluation.evaluator import Evaluator
from ..evaluation.levels import sample_groups
from ..evaluation.metrics import LevelMetrics, Metrics
from ..evaluation.pixel_metrics import SegmentationMetrics
from ..evaluation.slide_table import write_slide_csv
from ..infer.recorded_stain import COMMAND_KNOBS, StainChoice, refusing_broken_stain
from ..run.job import DataSpec, EvaluateJob, HeldOutSpec, RunOptions
from .args import add_parallel_args, add_workload_args
from .checkpoint_flags import add_checkpoint_flags, chosen_checkpoint
from .cohort_flags import add_level_args, check_evaluate_cohort
from .device_flags import add_device_flags, check_device_flags
from .evaluation_flags import DTYPES, add_evaluation_args, check_held_out_flags, check_numbers
from .model_flags import model_arg
from .parser import CommandParser, DefaultsHelpFormatter
from .resolution_flags import add_resolution_flags, check_resolution_flags, resolution_of
from .segmentation_flags import add_task_args
from .setup import exit_refused
from .stain_flags import add_no_stain_arg

if TYPE_CHECKING:
    from torch import nn

    from ..comm.protocol import Comm
    from ..data.dataset import RegionDataset
    from ..data.manifest import Cohort
    from ..infer.model import ModelDescription

# flag, ModelSpec field: a flag given on the command line must match the checkpoint's model (--model itself is
# checked by infer.model.load_trained, which knows named models such as torchvision:resnet50)
MODEL_FLAGS = (("--resnet-version", "resnet_version"), ("--num-layers", "num_layers"),
               ("--num-filters", "num_filters"), ("--num-classes", "num_classes"))


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
    loss_of: str = "cross-entropy"          # what ``loss`` is: the run's training loss (its class weights included)
    aggregate: str = "mean"                 # how tiles were aggregated into the slide and patient levels
    stain: str = "none"                     # the stain normaliser the images were read through (off, none)

    @property
    def levels(self) -> tuple[LevelMetrics, ...]:
        """Slide and patient level (images of known slides; empty otherwise)."""
        return self.metrics.levels if isinstance(self.metrics, Metrics) else ()

    def as_dict(self) -> dict[str, object]:
        chosen = {"checkpoint_select": self.selected, **({"best": self.best.to_dict()} if self.best else {})}
        return {"checkpoint": self.checkpoint, **chosen, "step": self.step, "model": self.model, "split": self.split,
                "app": self.app, "image_size": self.image_size, "batch_size": self.batch_size, "dtype": self.dtype,
                "world_size": self.world_size, **self.metrics.as_dict(), "loss_of": self.loss_of,
                **({"aggregate": self.aggregate} if self.levels else {}), "stain": self.stain,
                "seconds": self.seconds,
                "config": dict(self.config)}

    def table(self) -> str:
        """Tile-, slide- and patient-level figures, a line each (``evaluate`` prints it before its JSON)."""
        tile = self.metrics
        rows = [("level", "count", "accuracy", "balanced_acc", "roc_auc")]
        if isinstance(tile, Metrics):
            rows.append(("tile", str(tile.count), figure(tile.accuracy), figure(tile.balanced_accuracy),
                         figure(tile.roc_auc)))
        rows += [(m.level, str(m.count), figure(m.accuracy), figure(m.balanced_accuracy), figure(m.roc_auc))
                 for m in self.levels]
        return "\n".join("  ".join(cell.ljust(12) for cell in row).rstrip() for row in rows)

    def to_json(self) -> str:
        """The command's one JSON line."""
        return json.dumps(self.as_dict())


def figure(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


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
    add_level_args(parser)
    add_task_args(parser, training=False)
    add_no_stain_arg(parser)
    parser.set_defaults(image_size=None, batch_size=None, num_classes=None, app=None, num_epochs=1)
    return parser


def evaluate_job(args: argparse.Namespace, cfg: ParallelConfig) -> EvaluateJob:
    """The evaluation the checked flags name (None where the checkpoint's settings apply): a line per flag."""
    mpp, source_mpp = resolution_of(args)
    given = vars(args)
    return EvaluateJob(
        checkpoint=args.checkpoint, config=cfg, checkpoint_select=args.checkpoint_select,
        app=None if args.app is None else AppKind.parse(args.app),
        datapath=None if args.datapath is None else str(args.datapath), image_size=args.image_size,
        num_samples=args.num_samples, slide_level=args.slide_level, mpp=mpp, source_mpp=source_mpp,
        min_tissue=args.min_tissue, held_out=HeldOutSpec(args.val_fraction, args.val_datapath,
                                                               group_by=args.group_by, folds=args.folds,
                                                               fold=args.fold),
        all_data=args.all_data, batch_size=args.batch_size, dtype=args.dtype, seed=args.seed,
        task=None if args.task is None else Task.parse(args.task), model=args.model,
        model_flags=tuple((flag, key, given[key]) for flag, key in MODEL_FLAGS if given[key] is not None),
        options=RunOptions(backend=args.backend, device=args.device), cohort=args.cohort_data,
        aggregate=Aggregation.parse(args.aggregate), slide_csv=args.slide_csv, stain_normalize=args.stain_normalize)


def check_model_flags(job: EvaluateJob, record: RunRecord, where: str) -> None:
    """ConfigError when a model flag given names another model than the checkpoint's."""
    saved = record.model.to_dict()
    for flag, key, wanted in job.model_flags:
        if saved.get(key) is not None and wanted != saved[key]:
            raise ConfigError(flag, f"{where} holds a checkpoint of another model ({key} {saved[key]!r}, "
                              f"not {wanted!r}); drop {flag} or pass a checkpoint of that model")


def check_checkpoint_task(job: EvaluateJob, record: RunRecord, where: str) -> None:
    """ConfigError when ``--task`` names the other task than the checkpoint's."""
    from ..run.identity import task_mismatch

    problem = task_mismatch(record.task, job.task, where) if job.task is not None else None
    if problem is not None:
        raise ConfigError("--task", problem)


def resolved_data(job: EvaluateJob, record: RunRecord) -> DataSpec:
    """The data to read: the flags given, the checkpoint's settings for the rest (its training resolution unless
    ``--slide-level`` or ``--mpp``/``--magnification``)."""
    data = record.data
    cohort = cohort_to_read(job, record)
    app = AppKind.MEDICAL if cohort is not None else job.app or data.app
    mpp = None if job.slide_level is not None else (data.mpp if job.mpp is None else job.mpp)
    # no data flags: the data the checkpoint records (its folder or cohort), not the bundled sample
    datapath = job.datapath if job.app is not None or job.datapath is not None or cohort else data.datapath
    # the training run's class names order the labels of class folders (masks carry their labels as values)
    order = None if record.task.dense else label_order(folder_classes(app, datapath), data.classes)
    stain = StainChoice(record.stain, job.stain_normalize)
    if stain.applied is not None and app is not AppKind.MEDICAL:
        raise stain.refuse_unstained(f"--app {app}", COMMAND_KNOBS)
    return DataSpec(app=app, datapath=datapath, image_size=job.image_size or data.image_size,
                    num_samples=job.num_samples, slide_level=job.slide_level or 0, min_tissue=job.min_tissue,
                    mpp=mpp, source_mpp=job.source_mpp, num_classes=record.model.num_classes,
                    class_names=record.class_names, class_order=order, task=record.task,
                    ignore_index=record.segmentation.ignore_index if record.segmentation is not None else None,
                    cohort=cohort, whole_slide=data.whole_slide,
                    tissue_channel=data.whole_slide and record.model.pool.tissue,
                    stain=stain.applied)     # images read as the run read them (unless --no-stain-normalize)


def cohort_to_read(job: EvaluateJob, record: RunRecord) -> Cohort | None:
    """The cohort to evaluate: ``--cohort``'s, else (no data flags) the one the checkpoint records; its labels
    checked against the checkpoint's classes (ConfigError listing every line with another label)."""
    from ..data.manifest import read_cohort

    if job.cohort is not None:
        return read_cohort(job.cohort.source, record.class_names, probe=None)
    if job.app is None and job.datapath is None and record.data.cohort is not None:
        return read_cohort(record.data.cohort, record.class_names)
    return None


def other_cohort(job: EvaluateJob, record: RunRecord) -> bool:
    """Whether ``--cohort`` names another manifest than the one the checkpoint was trained on."""
    return job.cohort is not None and str(job.cohort.source) != record.data.cohort


def resolved_held_out(job: EvaluateJob, record: RunRecord) -> HeldOutSpec:
    """The images to evaluate: the flags' held-out images, every image (``--all-data``), else the run's split."""
    if job.all_data or other_cohort(job, record):      # another cohort: every slide of it
        return HeldOutSpec()
    if job.held_out.given:
        return job.held_out
    split = record.split
    if split is None:
        return HeldOutSpec(record.data.val_fraction, record.data.val_datapath)
    return HeldOutSpec(record.data.val_fraction, record.data.val_datapath, group_by=split.group_by,
                       folds=split.folds, fold=split.fold)


class Evaluation:
    """Set-up of ``evaluate`` in agreed stages (every rank the same verdict), then the run."""

    def __init__(self, job: EvaluateJob, ctx: Comm) -> None:
        self.job, self.ctx = job, ctx
        self.layers: list[nn.Module] = []
        self.record: RunRecord | None = None
        self.description: ModelDescription | None = None
        self.data = DataSpec()
        self.held_out = HeldOutSpec()
        self.batch_size = 0
        self.dtype = "float32"
        self.dataset: RegionDataset | None = None
        self.split = "all"
        self.stain = StainChoice(None)

    @property
    def seed(self) -> int:
        assert self.record is not None, "load() read the record"
        return self.job.seed if self.job.seed is not None else self.record.seed

    def load(self) -> None:
        """The checkpoint's network (refused if another model than the flags name) and data settings."""
        import torch

        from ..infer.model import load_trained
        from ..run.trainer import check_layout

        job = self.job
        dtype = getattr(torch, job.dtype) if job.dtype else None
        # rank 0 checksums the file; a damaged one stops every rank in this agreed stage. Without --dtype the
        # layers come in float64 (which holds either dtype exactly) and go to the checkpoint's dtype below
        self.layers, self.description, self.record = refusing_broken_stain(job.checkpoint, lambda: load_trained(
            job.checkpoint, job.model, dtype or torch.float64, check=self.ctx.rank == 0), COMMAND_KNOBS)
        self.stain = StainChoice(self.record.stain, job.stain_normalize)
        where = f"--checkpoint {self.description.path}"
        check_model_flags(job, self.record, where)
        check_checkpoint_task(job, self.record, where)
        if self.record.model.family.volumetric:
            raise ConfigError("--checkpoint", f"{self.description.path} holds a model of volumes "
                              f"({self.record.model.family.value}): evaluate takes image models only. A volume "
                              f"run's held-out figures (Dice per volume) are in its own summary and metrics.jsonl "
                              f"(train --val-fraction or --folds); infer --volume runs the model over a volume")
        self.data, self.held_out = resolved_data(job, self.record), resolved_held_out(job, self.record)
        self.dtype = job.dtype or self.record.data.dtype
        batch = job.batch_size or self.record.data.batch_size
        self.batch_size = -(-batch // job.config.batch_divisor) * job.config.batch_divisor
        if dtype is None:
            for layer in self.layers:
                layer.to(getattr(torch, self.dtype))
        check_layout(job.config, self.layers, self.batch_size, self.data.image_size)

    def open_data(self) -> None:
        """The images to evaluate: the training run's held-out split (checked to be the same), or all."""
        from ..run.job_data import dataset_from, held_out_data

        data = self.data
        dataset = dataset_from(data, self.seed, data.datapath)
        if dataset.num_classes > data.num_classes:
            raise ConfigError("--datapath", f"the data has {dataset.num_classes} classes, the checkpoint's "
                              f"model {data.num_classes}: a checkpoint of another model, or other data")
        _, held, self.split, _ = held_out_data(data, self.held_out, self.seed, dataset)
        assert self.record is not None, "load() read the record"
        saved = self.record.identity.get("val_split")
        explicit = self.job.held_out.given or self.job.all_data or other_cohort(self.job, self.record)
        if held is not None and saved not in (None, "none") and saved != self.split and not explicit:
            raise ConfigError("--datapath", f"the held-out images differ from the training run's "
                              f"({self.split!r}, trained with {saved!r}): give the same --app/--datapath/--num-samples/"
                              f"--image-size as the training run, or --val-fraction/--val-datapath/--all-data "
                              f"to evaluate other images on purpose")
        self.dataset = held if held is not None else dataset
        if self.job.slide_csv is not None and (data.task.dense or sample_groups(self.dataset, self.held_out.group_by)
                                               is None):
            raise ConfigError("--slide-csv", "tabulates slides, and these images come from none known; evaluate "
                                             "a --cohort, slides, or tiles named <slide>_<x>_<y> (--group-by)")

    def run(self) -> EvaluationSummary | None:
        """Evaluate (collective) with the run's loss; the summary on rank 0."""
        import time

        import torch

        from ..pipeline.engine import HybridEngine
        from ..run.held_out import evaluator_for

        assert self.description is not None and self.dataset is not None, "load() and open_data() ran"
        assert self.record is not None, "load() read the record"
        job, dtype = self.job, getattr(torch, self.dtype)
        engine = HybridEngine(self.layers, job.config, self.ctx, image_size=self.data.image_size,
                              loss_fn=self.record.loss())
        start = time.perf_counter()
        evaluator = evaluator_for(engine, self.dataset, self.ctx, self.batch_size, self.record, dtype,
                                  self.held_out.group_by, job.aggregate)
        if isinstance(evaluator, Evaluator) and evaluator.groups is not None:
            records = evaluator.records()          # rank 0: every tile's record, merged exactly
            if records is None:
                return None
            metrics: Metrics | SegmentationMetrics = evaluator.summary(records)
            if job.slide_csv is not None:
                write_slide_csv(job.slide_csv, evaluator.groups.slide_predictions(records, job.aggregate),
                                self.record.class_names)
        else:
            metrics = evaluator.run()
        if self.ctx.rank != 0:
            return None
        best = self.record.best if job.checkpoint_select == "best" else None
        return EvaluationSummary(self.description.path, self.description.step, self.description.describe(),
                                 self.split, str(self.data.app), self.data.image_size, self.batch_size, self.dtype,
                                 self.ctx.world_size, metrics, time.perf_counter() - start, job.config.as_dict(),
                                 job.checkpoint_select, best, self.record.loss().describe(),
                                 job.aggregate.describe(), self.stain.describe())


def run_evaluation(job: EvaluateJob, ctx: Comm) -> int:
    """Set up in agreed stages, evaluate, print the JSON line on rank 0; a refused set-up exits 2 on every rank
    with one message."""
    evaluation = Evaluation(job, ctx)
    try:
        agreed(ctx, evaluation.load)
        agreed(ctx, evaluation.open_data)
    except SetupFailed as err:
        exit_refused(ctx, "evaluate", err)
    header = evaluation.stain.header(COMMAND_KNOBS)
    if header is not None and ctx.rank == 0:
        print(f"mpi4dl_nb evaluate: {header}", file=sys.stderr, flush=True)
    summary = evaluation.run()
    if summary is not None:
        if summary.levels:
            print(summary.table(), file=sys.stderr, flush=True)
        print(summary.to_json(), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m mpi4dl_nb evaluate``."""
    from ..comm.context import init
    from .setup import parse_launch

    args, cfg = parse_launch(build_parser(), argv, check_flags)
    job = evaluate_job(args, cfg)
    return run_evaluation(job, init(backend=job.options.backend, device=job.options.device))


def check_flags(args: argparse.Namespace) -> None:
    """Errors in the checkpoint, numeric, held-out data and device flags, naming the flag (before any rank talks);
    ``args.checkpoint`` becomes the file chosen."""
    check_numbers(args)
    check_held_out_flags(args)
    check_evaluate_cohort(args)
    check_device_flags(args)
    check_resolution_flags(args)
    if args.slide_level is not None and (args.mpp is not None or args.magnification is not None):
        raise ConfigError("--slide-level", "give --slide-level or --mpp/--magnification, not both")
    args.checkpoint = chosen_checkpoint(args)
