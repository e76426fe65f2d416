"""``--task segmentation`` for train and evaluate: its flags and their checks (its data: ``run/job_data.py``).

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
from pathlib import Path

from ..checkpoint.record import RunRecord
from ..config import ConfigError
from ..data.apps import AppKind
from ..data.masks import is_mask_folder
from ..data.pathology import folder_files
from ..data.task import Task
from ..evaluation.metrics import MetricName
from ..models.spec import ModelFamily
from ..models.unet import UNetNorm, Upsampling
from ..run.identity import task_mismatch
from ..spatial.loss import LossKind

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
    """``train``'s task (``--task``)."""
    return Task.parse(args.task)


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
        given = vars(args)
        for flag, name, default in SEGMENTATION_ONLY:
            if given[name] != default:
                raise ConfigError(flag, "applies to --task segmentation only")
        if args.datapath is not None and is_mask_folder(args.datapath):
            raise ConfigError("--datapath", f"{args.datapath} holds images/ with their masks/ (per-pixel labels), "
                                            f"not class folders: add --task segmentation --model unet")
        return
    if family in CLASSIFIERS or (family.volumetric and not family.dense):
        raise ConfigError("--model", f"{family} is a classifier (one class per image); --task segmentation trains "
                                     f"a dense model: use --model {'unet3d' if family.volumetric else 'unet'}")
    for flag, value in (("--norm", args.norm), ("--upsampling", args.upsampling)):
        if value is not None and not family.dense:
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
    if args.datapath is not None:
        check_dense_labels(args.datapath)
    if annotated_slides(args) and args.classes is None:
        raise ConfigError("--classes", "annotated slides name their classes: give --classes in label order, the "
                                       "first for the pixels no annotation covers, e.g. background,tumor,stroma")
    if args.datapath is not None and not annotated_slides(args) and args.num_classes is None and args.classes is None:
        raise ConfigError("--num-classes", "masks hold class indices, not names: give --num-classes N (or "
                                           "--classes a,b,... in label order)")


def check_dense_labels(datapath: str) -> None:
    """ConfigError when ``--datapath`` holds image tiles (class folders) rather than images with masks or slides
    with annotations: segmentation would find no per-pixel labels there."""
    root = Path(datapath).expanduser()
    if not root.is_dir() or is_mask_folder(root):
        return
    files, slides = folder_files(root)
    if files and not slides:
        raise ConfigError("--task", f"{datapath} holds image tiles (class folders: one label per image), not "
                                    f"per-pixel labels; to classify them drop --task segmentation, to segment give "
                                    f"a folder with images/ and masks/ or slides with their QuPath GeoJSON beside them")


PER_TASK_METRICS = {Task.CLASSIFICATION: (MetricName.VAL_BALANCED_ACCURACY, MetricName.VAL_ROC_AUC),
                    Task.SEGMENTATION: (MetricName.VAL_MEAN_DICE, MetricName.VAL_MEAN_IOU)}


def check_task_classes(args: argparse.Namespace) -> None:
    """After the classes are known: ``--ignore-index`` must not be one of them, ``--keep-best`` a figure of the task."""
    task = task_of(args)
    best = args.keep_best
    other = [m for t, metrics in PER_TASK_METRICS.items() if t is not task for m in metrics]
    if best is not None and MetricName(best) in other:
        mine = ", ".join(m.value for m in (MetricName.VAL_LOSS, MetricName.VAL_ACCURACY, *PER_TASK_METRICS[task]))
        raise ConfigError("--keep-best", f"{best} is not a figure of --task {task}; use one of {mine}")
    ignore = args.ignore_index
    if task_of(args).dense and ignore is not None and 0 <= ignore < args.num_classes:
        raise ConfigError("--ignore-index", f"{ignore} is class {args.class_names[ignore]!r} of the "
                                            f"{args.num_classes} classes; use a value outside "
                                            f"0..{args.num_classes - 1} (e.g. 255)")


def task_classes(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The classes a segmentation run's data names (the IHC stand-in's; masks and annotations name none:
    ``--classes``/``--num-classes`` do)."""
    from ..data.sample import DAB_CLASSES

    return DAB_CLASSES if args.datapath is None else None


def check_checkpoint_task(args: argparse.Namespace, record: RunRecord, where: str) -> None:
    """``evaluate``: ConfigError when ``--task`` names the other task than the checkpoint's."""
    wanted = args.task
    problem = task_mismatch(record.task, Task.parse(wanted), where) if wanted is not None else None
    if problem is not None:
        raise ConfigError("--task", problem)
