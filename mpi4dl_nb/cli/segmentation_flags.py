"""``--task segmentation`` for train and evaluate: its flags and checks, the data with masks, its loss and evaluator.

A segmentation run reads per-pixel labels (``--app medical`` is implied by ``--datapath``):

* ``--datapath D`` with ``D/images/`` and ``D/masks/`` (same stems; ``--num-classes`` or ``--classes``);
* ``--datapath`` naming slides (a file or a folder) with QuPath GeoJSON beside each (``--classes`` names
  them, the first for the pixels no annotation covers);
* no ``--datapath``: the IHC sample with its DAB-positive stand-in mask (classes background, DAB).

Every image and mask (or slide and its annotations) is checked before the first step, and each refusal
names the file. A checkpoint of one task is refused where the other is asked for.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..checkpoint.record import RunRecord, SegmentationRecord
from ..config import ConfigError
from ..data.apps import AppKind
from ..data.masks import MaskDataset, is_mask_folder, pixel_counts
from ..data.pathology import folder_files
from ..data.task import Task
from ..data.validate import DataSources, SourceKind, find_sources
from ..evaluation.metrics import MetricName
from ..models.spec import ModelFamily
from ..models.unet import UNetNorm, Upsampling
from ..spatial.dense_loss import DenseLoss, LossKind

if TYPE_CHECKING:
    from ..comm.protocol import Comm
    from ..data.dataset import RegionDataset
    from ..evaluation.pixel_evaluator import SegmentationEvaluator
    from ..pipeline.engine import HybridEngine

Checker = Callable[[Path], str | None]
CLASSIFIERS = (ModelFamily.RESNET, ModelFamily.AMOEBANET)
SEGMENTATION_ONLY = (("--loss", "loss", LossKind.CE.value), ("--ignore-index", "ignore_index", None),
                     ("--norm", "norm", None), ("--upsampling", "upsampling", None))


def add_task_args(parser: argparse.ArgumentParser, training: bool = True) -> None:
    """``--task`` (``evaluate``: default the checkpoint's) and, for ``train``, the segmentation loss and U-Net flags."""
    g = parser.add_argument_group("task (segmentation)")
    g.add_argument("--task", choices=Task.values(), default=Task.CLASSIFICATION.value if training else None,
                   help="classification (a class per image) or segmentation (a class per pixel: masks or QuPath "
                        "annotations, a dense model such as --model unet)"
                        + ("" if training else "; refuse a checkpoint of the other task (default: the checkpoint's)"))
    if not training:
        return
    g.add_argument("--loss", choices=LossKind.values(), default=LossKind.CE.value,
                   help="segmentation: per-pixel cross-entropy, soft Dice, or their sum (--class-weights weigh both)")
    g.add_argument("--ignore-index", dest="ignore_index", type=int, default=None, metavar="LABEL",
                   help="segmentation: mask value of pixels no loss or metric counts (e.g. 255)")
    g.add_argument("--norm", choices=UNetNorm.values(), default=None,
                   help="U-Net: BatchNorm or GroupNorm after each convolution (default batch)")
    g.add_argument("--upsampling", choices=Upsampling.values(), default=None,
                   help="U-Net: bilinear up-sampling or 2x2 transposed convolutions (default bilinear)")


def task_of(args: argparse.Namespace) -> Task:
    """The run's task (classification when the flags have none)."""
    return Task.parse(getattr(args, "task", None) or Task.CLASSIFICATION.value)


def annotated_slides(args: argparse.Namespace) -> bool:
    """Whether a segmentation run reads slides with annotations (not a folder of images and masks)."""
    return args.datapath is not None and not is_mask_folder(args.datapath)


def check_task_args(args: argparse.Namespace) -> None:
    """Before the other checks: the task against the model, the segmentation flags, the data it needs (``--app
    medical`` implied by ``--datapath``); ConfigError naming the flag."""
    task, family = task_of(args), ModelFamily.parse(args.model)
    if not task.dense:
        if family.dense:
            raise ConfigError("--task", f"--model {family} predicts a class per pixel; add --task segmentation "
                                        f"(with masks or annotations as --datapath)")
        for flag, name, default in SEGMENTATION_ONLY:
            if getattr(args, name, default) != default:
                raise ConfigError(flag, "applies to --task segmentation only")
        if args.datapath is not None and is_mask_folder(args.datapath):
            raise ConfigError("--datapath", f"{args.datapath} holds images/ with their masks/ (per-pixel labels), "
                                            f"not class folders: add --task segmentation --model unet")
        return
    if family in CLASSIFIERS:
        raise ConfigError("--model", f"{family} is a classifier (one class per image); --task segmentation trains "
                                     f"a dense model: use --model unet")
    for flag, name in (("--norm", "norm"), ("--upsampling", "upsampling")):
        if getattr(args, name, None) is not None and not family.dense:
            raise ConfigError(flag, "sets a U-Net's layers; it applies to --model unet only")
    app = AppKind.parse(args.app)
    if app is AppKind.CIFAR:
        raise ConfigError("--app", "CIFAR-10 has no per-pixel labels; segmentation reads --datapath (images/ and "
                                   "masks/, or slides with QuPath GeoJSON) or --app medical (the IHC sample)")
    if args.datapath is not None:
        args.app = AppKind.MEDICAL
    elif app is AppKind.SYNTHETIC:
        raise ConfigError("--task", "segmentation needs per-pixel labels: --datapath D (D/images/ with D/masks/, "
                                    "or slides with their QuPath GeoJSON beside them), or --app medical for the IHC "
                                    "sample with its DAB-positive stand-in mask")
    if annotated_slides(args) and args.classes is None:
        raise ConfigError("--classes", "annotated slides name their classes: give --classes in label order, the "
                                       "first for the pixels no annotation covers, e.g. background,tumor,stroma")
    if args.datapath is not None and not annotated_slides(args) and args.num_classes is None and args.classes is None:
        raise ConfigError("--num-classes", "masks hold class indices, not names: give --num-classes N (or "
                                           "--classes a,b,... in label order)")


PER_TASK_METRICS = {Task.CLASSIFICATION: (MetricName.VAL_BALANCED_ACCURACY, MetricName.VAL_ROC_AUC),
                    Task.SEGMENTATION: (MetricName.VAL_MEAN_DICE, MetricName.VAL_MEAN_IOU)}


def check_task_classes(args: argparse.Namespace) -> None:
    """After the classes are known: ``--ignore-index`` must not be one of them, ``--keep-best`` a figure of the task."""
    task = task_of(args)
    best = getattr(args, "keep_best", None)
    other = [m for t, metrics in PER_TASK_METRICS.items() if t is not task for m in metrics]
    if best is not None and MetricName(best) in other:
        mine = ", ".join(m.value for m in (MetricName.VAL_LOSS, MetricName.VAL_ACCURACY, *PER_TASK_METRICS[task]))
        raise ConfigError("--keep-best", f"{best} is not a figure of --task {task}; use one of {mine}")
    ignore = getattr(args, "ignore_index", None)
    if task_of(args).dense and ignore is not None and 0 <= ignore < args.num_classes:
        raise ConfigError("--ignore-index", f"{ignore} is class {args.class_names[ignore]!r} of the "
                                            f"{args.num_classes} classes; use a value outside "
                                            f"0..{args.num_classes - 1} (e.g. 255)")


def task_classes(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The classes a segmentation run's data names (the IHC stand-in's; masks and annotations name none:
    ``--classes``/``--num-classes`` do)."""
    from ..data.sample import DAB_CLASSES

    return DAB_CLASSES if args.datapath is None else None


def segmentation_dataset(args: argparse.Namespace, datapath: str | Path | None,
                         exclude: Sequence[Path] = ()) -> MaskDataset:
    """The images with masks ``datapath`` names (without the files ``exclude``)."""
    from ..data.annotated_slides import AnnotatedSlideDataset
    from ..data.masks import MaskFolderDataset, image_files
    from ..data.pathology import require_path
    from ..data.sample import IHCMaskDataset
    from ..data.validate import excluded
    from .resolution_flags import resolution_of

    if datapath is None:
        return IHCMaskDataset(args.image_size)
    root = require_path(datapath)
    mpp, source_mpp = resolution_of(args)
    if is_mask_folder(root):
        return MaskFolderDataset(root, args.image_size, args.num_classes, files=excluded(image_files(root), exclude),
                                 mpp=mpp, source_mpp=source_mpp)
    slides = [root] if root.is_file() else slide_files(root, exclude)
    return AnnotatedSlideDataset(slides, args.image_size, args.class_names, level=args.slide_level,
                                 min_tissue=args.min_tissue, mpp=mpp, source_mpp=source_mpp)


def slide_files(root: Path, exclude: Sequence[Path]) -> list[Path]:
    """The slides of a folder of annotated slides; ConfigError when it holds neither slides nor images/ + masks/."""
    files, slides = folder_files(root, exclude)
    if not slides:
        raise ConfigError("--datapath", f"{root} holds neither images/ with masks/ nor slides with QuPath "
                                        f"annotations (<slide>.geojson beside each) for --task segmentation")
    return files


def data_sources(args: argparse.Namespace, datapath: str | None, knob: str) -> tuple[DataSources, Checker | None]:
    """The files the data check reads and how it checks each: images with their masks, slides with their
    annotations (segmentation), or the tiles/slides of ``find_sources`` (classification, checker None)."""
    if not task_of(args).dense:
        return find_sources(args.app, datapath, knob), None
    if datapath is None:
        return DataSources(None), None
    from ..data.annotated_slides import annotation_problems
    from ..data.masks import check_pair, image_files
    from ..data.pathology import require_path
    from ..data.validate import check_file

    root = require_path(datapath, knob)
    size, classes, ignore = args.image_size, args.num_classes, args.ignore_index
    if is_mask_folder(root):
        return (DataSources(SourceKind.TILES, tuple(image_files(root))),
                lambda image: check_pair(image, size, classes, ignore))
    sources = find_sources(AppKind.MEDICAL, datapath, knob)
    if sources.kind is not SourceKind.SLIDES:
        raise ConfigError(knob, f"{datapath} holds neither images/ with masks/ nor slides with QuPath annotations "
                                f"(<slide>.geojson beside each) for --task segmentation")
    names, level = args.class_names, args.slide_level
    return sources, lambda slide: (check_file(slide, SourceKind.SLIDES, size, level)
                                   or annotation_problems(slide, names))


def label_counts(args: argparse.Namespace, dataset: RegionDataset) -> list[int] | None:
    """A segmentation run's pixels per class when ``--class-weights balanced`` needs them (reads every mask), zeros
    when it does not; None for classification (the caller counts images)."""
    if not task_of(args).dense:
        return None
    if str(args.class_weights).strip().lower() != "balanced" or not isinstance(dataset, MaskDataset):
        return [0] * args.num_classes
    return pixel_counts(dataset, args.num_classes, args.ignore_index)


def dense_loss(record: RunRecord) -> DenseLoss:
    """The loss a segmentation record trains with (its kind, class weights and ignore index)."""
    pixels = record.segmentation or SegmentationRecord()
    weights = record.training.class_weights if record.training is not None else None
    return DenseLoss(LossKind(pixels.loss), weights, pixels.ignore_index)


def segmentation_record(args: argparse.Namespace) -> SegmentationRecord | None:
    """The pixel settings a segmentation run records (None for classification)."""
    return SegmentationRecord(args.loss, args.ignore_index) if task_of(args).dense else None


def task_identity(args: argparse.Namespace) -> dict[str, object]:
    """The run identity's task fields: the task, and a segmentation run's loss."""
    pixels = segmentation_record(args)
    found: dict[str, object] = {"task": str(task_of(args))}
    if pixels is not None:
        found["loss"] = f"{pixels.loss}, ignore {pixels.ignore_index}"
    return found


def saved_task(identity: Mapping[str, object]) -> Task:
    """The task of a checkpoint whose identity is ``identity`` (classification when it predates tasks)."""
    return Task.parse(str(identity.get("task") or Task.CLASSIFICATION.value))


def task_mismatch(theirs: Task, task: Task, where: str = "the checkpoint") -> str | None:
    """Why a checkpoint of task ``theirs`` cannot continue or be evaluated as ``task`` (None: it can)."""
    if theirs is task:
        return None
    return (f"{where} is a {theirs} checkpoint, not {task}: use --task {theirs} with it (its model predicts "
            f"{'a class per pixel' if theirs.dense else 'a class per image'})")


def check_checkpoint_task(args: argparse.Namespace, record: RunRecord, where: str) -> None:
    """``evaluate``: ConfigError when ``--task`` names the other task than the checkpoint's."""
    wanted = getattr(args, "task", None)
    problem = task_mismatch(record.task, Task.parse(wanted), where) if wanted is not None else None
    if problem is not None:
        raise ConfigError("--task", problem)


def evaluator(engine: HybridEngine, dataset: RegionDataset, ctx: Comm, batch_size: int, record: RunRecord,
              dtype: torch.dtype) -> SegmentationEvaluator:
    """The held-out evaluator of a segmentation run (pixel counts on the tiles, the run's loss)."""
    from ..evaluation.pixel_evaluator import SegmentationEvaluator

    if not isinstance(dataset, MaskDataset):
        raise TypeError(f"a segmentation evaluation needs images with masks, not {type(dataset).__name__}")
    return SegmentationEvaluator(engine, dataset, ctx, batch_size, dense_loss(record), dtype,
                                 classes=record.class_names)
