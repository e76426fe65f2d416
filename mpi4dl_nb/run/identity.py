"""A run's identity: named parts (model, data, sizes, seed, optimizer) compared field by field on resume."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..data.task import Task
from ..errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from ..models.spec import ModelSpec

# field -> the flags that set it (named in messages); a later issue may add fields here
FIELD_FLAGS: dict[str, str] = {
    "model": "--model/--resnet-version/--num-layers/--num-filters/--num-classes/--slide-encoder*",
    "dtype": "--dtype",
    "image_size": "--image-size",
    "batch_size": "--batch-size",
    "seed": "--seed",
    "app": "--app",
    "data": "--datapath and its files",
    "lr": "--lr",
    "momentum": "--momentum",
    "val_split": "--val-fraction/--val-datapath (and --seed)",
    "optimizer": "--optimizer/--lr/--momentum/--weight-decay/--layer-decay",
    "lr_schedule": "--lr-schedule/--warmup-steps/--lr-step-size/--lr-gamma (cosine and step: --steps)",
    "augment": "--augment",
    "pool": "--pool",
    "accumulate": "--accumulate",
    "class_weights": "--class-weights",
    "classes": "--classes (and the class folders)",
    "stain": "--stain-normalize/--stain-reference",
}


def digest(value: object, length: int = 12) -> str:
    """A short stable hash of a JSON-serialisable value (sorted keys)."""
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def field_name(text: str) -> str:
    """``--batch-size``, ``batch-size`` or ``batch_size`` -> ``batch_size``."""
    return text.strip().lstrip("-").replace("-", "_").lower()


def parse_allowed(values: Sequence[str] | None, known: Iterable[str] = FIELD_FLAGS) -> frozenset[str]:
    """``--allow-config-change`` values (repeated, comma-separated) as field names; ConfigError for unknown ones."""
    known = list(known)
    names = {field_name(part) for value in values or () for part in str(value).split(",") if part.strip()}
    unknown = sorted(names - set(known) - {"all"})
    if unknown:
        raise ConfigError("--allow-config-change", f"unknown field(s) {', '.join(unknown)}; name some of "
                          f"{', '.join(known)} (or 'all')")
    return frozenset(known) if "all" in names else frozenset(names)


@dataclass(frozen=True)
class Change:
    """One field whose value differs between a checkpoint and this run."""

    name: str
    saved: object
    current: object

    def __str__(self) -> str:
        return f"{self.name} {self.saved!r} -> {self.current!r}"


@dataclass(frozen=True)
class RunIdentity:
    """What a run trains: named parts, each a JSON value; two runs continue each other when all parts agree.

    ``fields`` maps a name (see ``FIELD_FLAGS``) to its value. Comparison is field by field;
    a field missing on one side (an older checkpoint, or a field added later) is not a change.
    """

    fields: Mapping[str, object]

    def as_dict(self) -> dict[str, object]:
        return dict(self.fields)

    @classmethod
    def from_dict(cls, data: Mapping[str, object] | None) -> RunIdentity:
        return cls(dict(data or {}))

    def changes_from(self, saved: RunIdentity) -> list[Change]:
        """Fields whose ``saved`` value differs from this run's, in ``FIELD_FLAGS`` order."""
        order = list(FIELD_FLAGS) + sorted(set(self.fields) - set(FIELD_FLAGS))
        return [Change(name, saved.fields[name], self.fields[name]) for name in order
                if name in self.fields and name in saved.fields and saved.fields[name] != self.fields[name]]

    def refused_changes(self, saved: RunIdentity, allowed: Iterable[str] = ()) -> list[Change]:
        """Changes not covered by ``allowed`` field names."""
        allowed = set(allowed)
        return [c for c in self.changes_from(saved) if c.name not in allowed]


def describe_changes(changes: Sequence[Change]) -> str:
    """``image_size 32 -> 64 (--image-size), seed 0 -> 1 (--seed)``."""
    return ", ".join(f"{c} ({FIELD_FLAGS.get(c.name, c.name)})" for c in changes)


def refuse_changes(where: str, changes: Sequence[Change]) -> ConfigError:
    """The error for a resume whose configuration changed (what changed and the way out)."""
    names = ",".join(c.name for c in changes)
    return ConfigError("--resume", f"{where} was written by a run with another configuration: "
                       f"{describe_changes(changes)}. Resume with the same flags, or pass "
                       f"--allow-config-change {names} to continue anyway (then the run is no "
                       f"longer equal to an uninterrupted one)")


def model_fingerprint(spec: ModelSpec, layers: Sequence[nn.Module]) -> str:
    """The model part of the run identity: its spec and a hash of every tensor's name, shape and dtype
    (the text checkpoints on disk compare against: keep it as it is)."""
    shapes = [(f"{i}.{k}", list(v.shape), str(v.dtype)) for i, layer in enumerate(layers)
              for k, v in layer.state_dict().items()]
    if spec.family.named:
        return f"{spec.label}, {spec.num_classes} classes [{digest(shapes)}]"
    version = f" v{spec.resnet_version}" if spec.resnet_version else ""
    encoded = f", {spec.slide_encoder.describe()}" if spec.slide_encoder is not None else ""   # heads: no shape
    return (f"{spec.family}{version}, {spec.num_layers} layers, {spec.num_filters} filters, "
            f"{spec.num_classes} classes{encoded} [{digest(shapes)}]")


def saved_task(identity: Mapping[str, object]) -> Task:
    """The task of a checkpoint whose identity is ``identity`` (classification when it predates tasks)."""
    return Task.parse(str(identity.get("task") or Task.CLASSIFICATION.value))


def task_mismatch(theirs: Task, task: Task, where: str = "the checkpoint") -> str | None:
    """Why a checkpoint of task ``theirs`` cannot continue or be evaluated as ``task`` (None: it can)."""
    if theirs is task:
        return None
    return (f"{where} is a {theirs} checkpoint, not {task}: use --task {theirs} with it (its model predicts "
            f"{'a class per pixel' if theirs.dense else 'a class per image'})")
