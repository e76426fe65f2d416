"""How ``train`` trains (TrainingSpec: batches, length, seed, dtype, optimizer, learning-rate schedule, class weights,
augmentation, loss, accumulation, clipping): its flags and their checks, the schedule and record of a run of N steps."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checkpoint.record import TrainingRecord
from ..config import DTYPE
from ..data.augment import AugmentSpec
from ..data.classes import class_weights, parse_class_weights
from ..errors import ConfigError
from ..loss import LossKind
from ..pipeline.optim import DEFAULT_GAMMA, LRSchedule, LRScheduleKind, OptimizerKind, OptimizerSpec
from ..schema import Bounds, check_bounds, flag, number, option, whole_number
from . import flag_groups as groups

ClassWeights = tuple[float, ...] | str | None      # one weight per class, "balanced" (from the counts), or none
# the run options train shares with evaluate and tune, declared once (``OPTION.field(default)`` in each job)
BATCH_SIZE = option("--batch-size", "global batch size", parse=whole_number, bounds=Bounds(1), group=groups.WORKLOAD)
NUM_EPOCHS = option("--num-epochs", "number of epochs", parse=whole_number, bounds=Bounds(1), group=groups.WORKLOAD)
STEPS = option("--steps", "optimizer steps (train: in all; tune: timed per configuration and round)",
               parse=whole_number, bounds=Bounds(1), group=groups.RUN)
SEED = option("--seed", "seed of the weights, the data order and the --val-fraction split", parse=whole_number,
              bounds=Bounds(0), group=groups.RUN)


@dataclass(frozen=True)
class OptimizerChoice:
    """``--optimizer``, ``--lr``, ``--momentum``, ``--weight-decay`` (momentum and weight decay default per
    optimizer), ``--layer-decay``: the OptimizerSpec every rank builds."""

    kind: OptimizerKind = flag("--optimizer", "sgd (with --momentum) or adamw (decoupled weight decay)",
                               OptimizerKind.SGD, parse=OptimizerKind, choices=OptimizerKind.values(),
                               group=groups.TRAINING)
    lr: float = flag("--lr", "learning rate (the peak, after warm-up)", 0.01, parse=number,
                     bounds=Bounds(0, closed=False), group=groups.TRAINING)
    momentum: float | None = flag("--momentum", "SGD momentum (default 0.9; not with adamw)", None, parse=number,
                                  bounds=Bounds(0, 1), group=groups.TRAINING)
    weight_decay: float | None = flag("--weight-decay", "weight decay of every parameter (default: 0 for sgd, 0.01 "
                                                        "for adamw)", None, parse=number, bounds=Bounds(0),
                                      group=groups.TRAINING)
    layer_decay: float | None = flag("--layer-decay", "a vision transformer's rates decayed block by block (BEiT's): "
                                                      "with L blocks, block i trains at --lr x F^(L-i), the embedding "
                                                      "at --lr x F^(L+1), the final norm and head at --lr; F in (0, 1]",
                                     None, parse=number, bounds=Bounds(0, 1, closed=False), metavar="F",
                                     group=groups.TRAINING)

    def __post_init__(self) -> None:
        check_bounds(self)
        OptimizerSpec.of(self.kind, self.lr, self.momentum, self.weight_decay,
                         self.layer_decay)   # adamw with --momentum refused, --layer-decay outside (0, 1]

    @property
    def spec(self) -> OptimizerSpec:
        return OptimizerSpec.of(self.kind, self.lr, self.momentum, self.weight_decay, self.layer_decay)


@dataclass(frozen=True)
class TrainingSpec:
    """How the run trains: batches, length, seed, dtype, optimizer and schedule, class weights, augmentation."""

    batch_size: int = BATCH_SIZE.field(32)
    num_epochs: int = NUM_EPOCHS.field(1)
    steps: int | None = STEPS.field(None, default_text="num-epochs x batches per epoch")
    seed: int = SEED.field(0)
    dtype: str = DTYPE.field("float32", group=groups.RUN)
    optimizer: OptimizerChoice = field(default_factory=OptimizerChoice)
    lr_schedule: LRScheduleKind = flag(
        "--lr-schedule", "learning rate over the steps after warm-up: constant, cosine (to 0 at the last step) or "
                         "step (x --lr-gamma every --lr-step-size steps)", LRScheduleKind.CONSTANT,
        parse=LRScheduleKind, choices=LRScheduleKind.values(), group=groups.TRAINING)
    warmup_steps: int = flag("--warmup-steps", "linear warm-up over the first N steps (step s at (s+1)/(N+1) of --lr)",
                             0, parse=whole_number, metavar="N", group=groups.TRAINING)
    lr_step_size: int | None = flag("--lr-step-size", "--lr-schedule step: decay every N steps (default: at each "
                                                      "third of the steps after warm-up)", None, parse=whole_number,
                                    metavar="N", bounds=Bounds(1), group=groups.TRAINING)
    lr_gamma: float = flag("--lr-gamma", "--lr-schedule step: the factor of each decay", DEFAULT_GAMMA, parse=number,
                           bounds=Bounds(0, 1, closed=False), group=groups.TRAINING)
    class_weights: ClassWeights = flag(
        "--class-weights", "weight of each class in the training loss (a per-sample weighted cross-entropy averaged "
                           "over the samples); balanced: N/(K*n_c) from the training images per class", None,
        parse=parse_class_weights, metavar="W1,W2,...|balanced", group=groups.TRAINING)
    augment: AugmentSpec = flag(
        "--augment", "augment the training images (any subset): flips, 90-degree turns, colour jitter, stain (HED) "
                     "jitter; drawn per (--seed, step, image), tiles see the augmented whole image",
        default_factory=AugmentSpec, parse=AugmentSpec.parse, metavar="flip,rot90,color,hed", group=groups.TRAINING)
    loss: LossKind = flag("--loss", "segmentation: per-pixel cross-entropy, soft Dice, or their sum (--class-weights "
                                    "weigh both)", LossKind.CE, parse=LossKind, choices=LossKind.values(),
                          group=groups.TASK)
    accumulate: int = flag("--accumulate", "gradient accumulation: N batches (micro-steps) per optimizer step, which "
                                           "uses their mean gradient; --steps counts optimizer steps", 1,
                           parse=whole_number, metavar="N", group=groups.TRAINING)
    balanced_sampler: bool = flag(
        "--balanced-sampler", "draw each class equally often (minority classes' images repeated, majority ones' "
                              "left out within an epoch), within a class each slide or patient in turn where the "
                              "data is grouped (--group-by, a cohort, TCGA names); seeded as the shuffle is: the same "
                              "batches on every rank and on resume", False, switch=True, group=groups.TRAINING)
    clip_grad_norm: float | None = flag(
        "--clip-grad-norm", "before each optimizer step scale the gradient down to this global L2 norm when above "
                            "it (torch.nn.utils.clip_grad_norm_'s max_norm, timm's --clip-grad; the norm of the whole "
                            "model's gradient over every rank; default: never)", None, parse=number,
        bounds=Bounds(0, closed=False), metavar="N", group=groups.TRAINING)

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.accumulate < 1:
            raise ConfigError("--accumulate", f"must be >= 1 (batches per optimizer step), got {self.accumulate}")
        if self.warmup_steps < 0:
            raise ConfigError("--warmup-steps", f"must be >= 0, got {self.warmup_steps}")
        # with epochs: checked again once the steps are known
        self.schedule(self.steps if self.steps is not None else self.warmup_steps + 1)

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    def schedule(self, steps: int) -> LRSchedule:
        """The learning-rate schedule of a run of ``steps`` steps."""
        return LRSchedule(self.lr_schedule, steps, self.warmup_steps, self.lr_step_size, self.lr_gamma)

    def record(self, steps: int, counts: list[int]) -> TrainingRecord:
        """How the run trains, with ``counts`` training images (or pixels) per class for ``balanced`` weights."""
        weights = None if self.class_weights is None else class_weights(self.class_weights, counts)
        return TrainingRecord(self.optimizer.spec, self.schedule(steps), self.augment, weights)
