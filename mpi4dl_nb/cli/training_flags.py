"""How ``train`` trains: the optimizer, schedule, class, weight and augmentation flags, checked before any rank
talks, and the class names they resolve."""
from __future__ import annotations

import argparse

from ..config import ConfigError
from ..data.augment import AugmentSpec
from ..data.classes import (
    folder_classes,
    label_order,
    parse_class_weights,
    parse_names,
    resolve_names,
)
from ..data.volume_classes import volume_classes
from ..evaluation.metrics import MetricName
from ..models.pools import PoolKind
from ..models.spec import split_model
from ..pipeline.optim import DEFAULT_GAMMA, LRSchedule, LRScheduleKind, OptimizerKind, OptimizerSpec
from .segmentation_flags import task_classes, task_of
from .volume_flags import is_volume_run


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """The optimizer, learning-rate schedule, class and augmentation flags of ``train``."""
    g = parser.add_argument_group("optimizer, schedule, classes and augmentation")
    g.add_argument("--optimizer", choices=OptimizerKind.values(), default=OptimizerKind.SGD.value,
                   help="sgd (with --momentum) or adamw (decoupled weight decay)")
    g.add_argument("--lr", type=float, default=0.01, help="learning rate (the peak, after warm-up)")
    g.add_argument("--momentum", type=float, default=None,
                   help="SGD momentum (default 0.9; not with adamw)")
    g.add_argument("--weight-decay", dest="weight_decay", type=float, default=None,
                   help="weight decay of every parameter (default: 0 for sgd, 0.01 for adamw)")
    g.add_argument("--lr-schedule", dest="lr_schedule", choices=LRScheduleKind.values(),
                   default=LRScheduleKind.CONSTANT.value,
                   help="learning rate over the steps after warm-up: constant, cosine (to 0 at the last step) "
                        "or step (x --lr-gamma every --lr-step-size steps)")
    g.add_argument("--warmup-steps", dest="warmup_steps", type=int, default=0, metavar="N",
                   help="linear warm-up over the first N steps (step s at (s+1)/(N+1) of --lr)")
    g.add_argument("--lr-step-size", dest="lr_step_size", type=int, default=None, metavar="N",
                   help="--lr-schedule step: decay every N steps (default: at each third of the steps after "
                        "warm-up)")
    g.add_argument("--lr-gamma", dest="lr_gamma", type=float, default=DEFAULT_GAMMA,
                   help="--lr-schedule step: the factor of each decay")
    g.add_argument("--classes", default=None, metavar="A,B,...",
                   help="class names in label order (default: the class folders' names, sorted); with class "
                        "folders every folder must be named, and their order sets the labels")
    g.add_argument("--class-weights", dest="class_weights", default=None, metavar="W1,W2,...|balanced",
                   help="weight of each class in the training loss (a per-sample weighted cross-entropy averaged "
                        "over the samples); balanced: N/(K*n_c) from the training images per class")
    g.add_argument("--pool", choices=PoolKind.values(), default=PoolKind.AVG.value,
                   help="the classifier head's global pool (a named model's global average pool replaced): avg; "
                        "max (per channel over every position); tissue-mean (over the positions the input's last "
                        "channel, a tissue mask, marks; resnet, amoebanet only); attention (gated "
                        "attention-MIL); exact on tiles")
    g.add_argument("--accumulate", type=int, default=1, metavar="N",
                   help="gradient accumulation: N batches (micro-steps) per optimizer step, which uses their mean "
                        "gradient; --steps counts optimizer steps")
    g.add_argument("--augment", default=None, metavar="flip,rot90,color,hed",
                   help="augment the training images (any subset): flips, 90-degree turns, colour jitter, stain "
                        "(HED) jitter; drawn per (--seed, step, image), tiles see the augmented whole image")


def check_training_args(args: argparse.Namespace) -> None:
    """ConfigError for a bad optimizer, schedule, class, weight or augmentation flag; fills in
    ``args.class_names``, ``args.num_classes`` and ``args.class_order`` (the names ordering the class folders'
    labels, None for other data) from the data and ``--classes``."""
    optimizer_spec(args)
    if args.accumulate < 1:
        raise ConfigError("--accumulate", f"must be >= 1 (batches per optimizer step), got {args.accumulate}")
    family, _ = split_model(args.model)
    pool = PoolKind(args.pool)
    if pool is not PoolKind.AVG and family.dense:
        raise ConfigError("--pool", f"--pool {args.pool} replaces a classifier's global pool; --model {args.model} "
                                    f"outputs a class per pixel and pools nothing: drop --pool")
    if pool.tissue and family.named:
        raise ConfigError("--pool", f"--pool tissue-mean needs the tissue mask carried through the trunk, which only "
                                    f"this project's classifiers do (--model resnet or amoebanet); --model "
                                    f"{args.model} takes --pool max or attention (its global average pool replaced)")
    if args.warmup_steps < 0:
        raise ConfigError("--warmup-steps", f"must be >= 0, got {args.warmup_steps}")
    LRSchedule(LRScheduleKind(args.lr_schedule), args.steps if args.steps is not None else args.warmup_steps + 1,
               args.warmup_steps, args.lr_step_size, args.lr_gamma)   # with epochs: checked again once they are known
    AugmentSpec.parse(args.augment)
    weights = parse_class_weights(args.class_weights)
    given = parse_names(args.classes)
    found = (task_classes(args) if task_of(args).dense else volume_classes(args.datapath) if is_volume_run(args)
             else folder_classes(args.app, args.datapath))
    cohort = args.cohort_data                               # --cohort: the manifest's classes
    found = found if cohort is None else cohort.classes
    args.class_names = resolve_names(args.app, found, given, args.num_classes, "--cohort" if cohort else "--datapath")
    args.class_order = None if task_of(args).dense else label_order(found, args.class_names)   # masks: values
    args.num_classes = len(args.class_names)
    if isinstance(weights, tuple) and len(weights) != args.num_classes:
        raise ConfigError("--class-weights", f"gives {len(weights)} weights for {args.num_classes} classes "
                                             f"({', '.join(args.class_names)}); give one per class, in that order")


def check_keep_best(args: argparse.Namespace) -> None:
    """``--keep-best`` needs validation data and a checkpoint directory; ROC AUC exists for two classes only."""
    if args.keep_best is None:
        return
    if args.checkpoint_dir is None:
        raise ConfigError("--keep-best", "keeps the best checkpoint in --checkpoint-dir: give one")
    if args.val_fraction is None and args.val_datapath is None and args.folds is None:
        raise ConfigError("--keep-best", "measures checkpoints on validation data: add --val-fraction F or "
                                         "--val-datapath DIR")
    if args.keep_best == MetricName.VAL_ROC_AUC and args.num_classes != 2:
        raise ConfigError("--keep-best", f"val_roc_auc is defined for 2 classes, this run has {args.num_classes}; "
                                         f"use val_loss, val_accuracy or val_balanced_accuracy")


def optimizer_spec(args: argparse.Namespace) -> OptimizerSpec:
    """The optimizer the flags name (momentum and weight decay default per optimizer)."""
    return OptimizerSpec.of(args.optimizer, args.lr, args.momentum, args.weight_decay)
