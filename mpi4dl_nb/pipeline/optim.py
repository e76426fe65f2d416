"""OptimizerSpec (SGD or AdamW, weight decay) every rank builds for its parameters, and LRSchedule: the learning
rate as a pure function of the step (constant, cosine or step decay after a linear warm-up).

``OptimizerSpec.build`` is an optimizer factory for ``HybridEngine(..., optimizer=spec.build)``: every holder
of a stage builds the same optimizer over its copy of the stage's parameters, receives the same summed
gradients and so takes the same step (AdamW's moments are the same on every holder). The schedule keeps no
state: ``LRSchedule.apply(optimizer, step)`` sets the rate of optimizer step ``step`` (0-based) before it
is taken, so a resumed run continues it exactly from its step count alone. A parameter group built at a scaled
rate (``--layer-decay``: ``pipeline/layer_decay.py``, the group's ``lr_scale`` times ``--lr``) keeps its scale: the
schedule multiplies each group's own peak.

Rates (``lr`` the peak, ``w`` the warm-up steps, ``T`` the run's total steps, ``s`` the step)::

    warm-up  s < w:   lr * (s + 1) / (w + 1)
    constant s >= w:  lr
    cosine   s >= w:  lr * (1 + cos(pi * (s - w) / (T - w))) / 2
    step     s >= w:  lr * gamma ** ((s - w) // step_size)
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from ..config import Choice
from ..errors import ConfigError

ADAMW_BETAS = (0.9, 0.999)
ADAMW_EPS = 1e-8
DEFAULT_MOMENTUM = 0.9          # SGD's, when none is given
DEFAULT_WEIGHT_DECAY = {"sgd": 0.0, "adamw": 0.01}
DEFAULT_GAMMA = 0.1
STEP_PHASES = 3                 # the step schedule's default: decay at each third of the steps after warm-up
K = TypeVar("K", bound=Choice)


class OptimizerKind(Choice):
    """The optimizer of ``--optimizer``."""

    SGD = "sgd"
    ADAMW = "adamw"


class LRScheduleKind(Choice):
    """The learning-rate schedule of ``--lr-schedule``."""

    CONSTANT = "constant"
    COSINE = "cosine"
    STEP = "step"


def _kind(choice: type[K], data: Mapping[str, object], default: K) -> K:
    """``data["kind"]`` as a member of ``choice`` (``default`` when missing); ValueError naming the field."""
    try:
        return choice(str(data.get("kind", default)))
    except ValueError as err:
        raise ValueError(f"field 'kind': {err}") from None


def _number(data: Mapping[str, object], key: str, default: float | None = None) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"field {key!r}: expected a number, got {value!r}")
    return float(value)


def _count(data: Mapping[str, object], key: str, default: int | None = None) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"field {key!r}: expected a whole number, got {value!r}")
    return value


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer every rank builds: kind, peak learning rate, SGD momentum, weight decay (decoupled for
    AdamW, L2 for SGD, applied to every parameter); ``layer_decay`` (None: none): a transformer's rates decayed
    block by block (``pipeline/layer_decay.py``; the run builds the groups, ``ScaledOptimizer``)."""

    kind: OptimizerKind = OptimizerKind.SGD
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    layer_decay: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", OptimizerKind(self.kind))
        for flag, value, low, high in (("--lr", self.lr, 0.0, None), ("--momentum", self.momentum, 0.0, 1.0),
                                       ("--weight-decay", self.weight_decay, 0.0, None)):
            if not math.isfinite(value) or value < low or (high is not None and value > high):
                bound = f">= {low:g}" + (f" and <= {high:g}" if high is not None else "")
                raise ConfigError(flag, f"must be a number {bound}, got {value:g}")
        if self.layer_decay is not None and (not math.isfinite(self.layer_decay)
                                             or not 0.0 < self.layer_decay <= 1.0):
            raise ConfigError("--layer-decay", f"must lie in (0, 1] (1: no decay), got {self.layer_decay:g}")
        if self.kind is OptimizerKind.ADAMW and self.momentum:
            raise ConfigError("--momentum", "applies to --optimizer sgd; AdamW keeps its own moments "
                                            f"(betas {ADAMW_BETAS}): drop --momentum")

    @classmethod
    def of(cls, kind: OptimizerKind | str, lr: float, momentum: float | None = None,
           weight_decay: float | None = None, layer_decay: float | None = None) -> OptimizerSpec:
        """The spec of the command-line flags: momentum and weight decay default per optimizer."""
        kind = OptimizerKind(kind)
        if momentum is None:
            momentum = DEFAULT_MOMENTUM if kind is OptimizerKind.SGD else 0.0
        if weight_decay is None:
            weight_decay = DEFAULT_WEIGHT_DECAY[kind.value]
        return cls(kind, lr, momentum, weight_decay, layer_decay)

    @property
    def state_slots(self) -> int:
        """Parameter-sized buffers the optimizer keeps per parameter (momentum; AdamW's two moments)."""
        if self.kind is OptimizerKind.ADAMW:
            return 2
        return 1 if self.momentum > 0 else 0

    def build(self, params: Iterable[nn.Parameter] | Iterable[dict[str, Any]]) -> torch.optim.Optimizer:
        """The optimizer over ``params`` (an optimizer factory for ``HybridEngine``), or over parameter groups (each
        with its own ``lr``)."""
        if self.kind is OptimizerKind.ADAMW:
            return torch.optim.AdamW(params, lr=self.lr, betas=ADAMW_BETAS, eps=ADAMW_EPS,
                                     weight_decay=self.weight_decay)
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)

    def describe(self) -> str:
        """``adamw lr 0.001, weight decay 0.05`` / ``sgd lr 0.01, momentum 0.9``."""
        parts = [f"{self.kind} lr {self.lr:g}"]
        if self.kind is OptimizerKind.SGD:
            parts.append(f"momentum {self.momentum:g}")
        if self.weight_decay:
            parts.append(f"weight decay {self.weight_decay:g}")
        if self.layer_decay is not None:
            parts.append(f"layer decay {self.layer_decay:g}")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind.value, "lr": self.lr, "momentum": self.momentum,
                "weight_decay": self.weight_decay, "layer_decay": self.layer_decay}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> OptimizerSpec:
        """The spec ``to_dict`` stored (no ``layer_decay``: a record from before it, none); ValueError naming a bad
        field."""
        decay = data.get("layer_decay")
        return cls(_kind(OptimizerKind, data, OptimizerKind.SGD), _number(data, "lr"),
                   _number(data, "momentum", 0.0), _number(data, "weight_decay", 0.0),
                   None if decay is None else _number(data, "layer_decay"))


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate of every step of a run of ``total_steps`` steps (see the module's table)."""

    kind: LRScheduleKind = LRScheduleKind.CONSTANT
    total_steps: int = 1
    warmup_steps: int = 0
    step_size: int | None = None      # the step schedule: decay every this many steps (None: a third)
    gamma: float = DEFAULT_GAMMA      # the step schedule's factor per decay

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", LRScheduleKind(self.kind))
        if self.total_steps < 1:
            raise ConfigError("--steps", f"a schedule needs at least one step, got {self.total_steps}")
        if self.warmup_steps < 0 or self.warmup_steps >= self.total_steps:
            raise ConfigError("--warmup-steps", f"must be >= 0 and below the run's {self.total_steps} steps, "
                                                f"got {self.warmup_steps}")
        if self.step_size is not None and self.step_size < 1:
            raise ConfigError("--lr-step-size", f"must be >= 1, got {self.step_size}")
        if not (0.0 < self.gamma <= 1.0):
            raise ConfigError("--lr-gamma", f"must lie in (0, 1], got {self.gamma:g}")

    @property
    def decay_every(self) -> int:
        """Steps between two decays of the step schedule."""
        if self.step_size is not None:
            return self.step_size
        return max(1, -(-(self.total_steps - self.warmup_steps) // STEP_PHASES))

    def factor(self, step: int) -> float:
        """The share of the peak rate optimizer step ``step`` (0-based) takes."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        after = step - self.warmup_steps
        if self.kind is LRScheduleKind.COSINE:
            return 0.5 * (1.0 + math.cos(math.pi * after / (self.total_steps - self.warmup_steps)))
        if self.kind is LRScheduleKind.STEP:
            return self.gamma ** (after // self.decay_every)
        return 1.0

    def apply(self, optimizer: torch.optim.Optimizer | None, step: int) -> None:
        """Set every parameter group's rate for optimizer step ``step``: its peak (the rate it was built with,
        kept as ``initial_lr`` as torch's schedulers keep it) times ``factor(step)``."""
        if optimizer is None:
            return
        for group in optimizer.param_groups:
            peak = group.setdefault("initial_lr", group["lr"])
            group["lr"] = peak * self.factor(step)

    def describe(self) -> str:
        """What the identity of a run compares: the kind, its warm-up, and what the rates depend on."""
        text = str(self.kind)
        if self.kind is LRScheduleKind.COSINE:
            text += f" over {self.total_steps} steps"
        elif self.kind is LRScheduleKind.STEP:
            text += f" x{self.gamma:g} every {self.decay_every} steps"
        return text + (f", warm-up {self.warmup_steps}" if self.warmup_steps else "")

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind.value, "total_steps": self.total_steps, "warmup_steps": self.warmup_steps,
                "step_size": self.step_size, "gamma": self.gamma}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> LRSchedule:
        """The schedule ``to_dict`` stored; ValueError naming a bad field."""
        size = data.get("step_size")
        return cls(_kind(LRScheduleKind, data, LRScheduleKind.CONSTANT), _count(data, "total_steps"),
                   _count(data, "warmup_steps", 0), None if size is None else _count(data, "step_size"),
                   _number(data, "gamma", DEFAULT_GAMMA))
