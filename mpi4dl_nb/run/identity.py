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
    from ..pipeline.optim import OptimizerSpec

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
    "clip_grad_norm": "--clip-grad-norm",
    "class_weights": "--class-weights",
    "classes": "--classes (and the class folders)",
    "stain": "--stain-normalize/--stain-reference",
    "sampler": "--balanced-sampler",
}
FLAGS = "flags"      # the identity's value of each flag below: names what changed, compared through its field
# flag -> the field it enters (a field holding several flags: the model's fingerprint, the optimizer's description)
FLAG_FIELDS: dict[str, str] = {
    **dict.fromkeys(("--model", "--resnet-version", "--num-layers", "--num-filters", "--num-classes", "--model-args",
                     "--slide-encoder", "--slide-encoder-layers", "--slide-encoder-heads", "--norm", "--upsampling",
                     "--train-blocks", "--lora-rank", "--lora-alpha", "--lora-targets"), "model"),
    **dict.fromkeys(("--optimizer", "--lr", "--momentum", "--weight-decay", "--layer-decay"), "optimizer"),
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
    """One field whose value differs between a checkpoint and this run, and the flags that changed it (when both
    identities name them: ``--lora-rank 8 -> 4``)."""

    name: str
    saved: object
    current: object
    flags: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.flags:
            return f"{self.name}: {', '.join(self.flags)}"
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
        """Fields whose ``saved`` value differs from this run's, in ``FIELD_FLAGS`` order, each with the flags that
        changed it; a field is changed too when only a flag of it changed (LoRA's alpha: no tensor's shape)."""
        flags = changed_flags(saved.fields.get(FLAGS), self.fields.get(FLAGS))
        order = list(FIELD_FLAGS) + sorted(set(self.fields) - set(FIELD_FLAGS) - {FLAGS})
        return [Change(name, saved.fields[name], self.fields[name], flags.get(name, ())) for name in order
                if name in self.fields and name in saved.fields
                and (saved.fields[name] != self.fields[name] or name in flags)]

    def refused_changes(self, saved: RunIdentity, allowed: Iterable[str] = ()) -> list[Change]:
        """Changes not covered by ``allowed`` field names."""
        allowed = set(allowed)
        return [c for c in self.changes_from(saved) if c.name not in allowed]


def changed_flags(saved: object, current: object) -> dict[str, tuple[str, ...]]:
    """Field -> its flags whose value differs between two identities' ``flags`` (``--lora-rank 8 -> 4``); none when
    one side names no flags (a checkpoint written before they were recorded)."""
    if not isinstance(saved, Mapping) or not isinstance(current, Mapping):
        return {}
    found: dict[str, tuple[str, ...]] = {}
    for flag, field in FLAG_FIELDS.items():
        if flag in saved and flag in current and saved[flag] != current[flag]:
            found[field] = (*found.get(field, ()), f"{flag} {saved[flag]} -> {current[flag]}")
    return found


def identity_flags(spec: ModelSpec, optimizer: OptimizerSpec) -> dict[str, str]:
    """The value of every flag of ``FLAG_FIELDS`` this run has (the identity's ``flags``): what a resume names when
    the model's fingerprint or the optimizer changed."""
    encoder, lora = spec.slide_encoder, spec.lora
    values: dict[str, object] = {
        "--model": spec.label, "--resnet-version": spec.resnet_version, "--num-layers": spec.num_layers,
        "--num-filters": spec.num_filters, "--num-classes": spec.num_classes, "--model-args": spec.model_args.text(),
        "--slide-encoder": None if encoder is None else encoder.kind,
        "--slide-encoder-layers": None if encoder is None else encoder.layers,
        "--slide-encoder-heads": None if encoder is None else encoder.heads,
        "--norm": spec.norm, "--upsampling": spec.upsampling, "--train-blocks": spec.train_blocks,
        "--lora-rank": None if lora is None else lora.rank, "--lora-alpha": None if lora is None else f"{lora.alpha:g}",
        "--lora-targets": None if lora is None else ",".join(lora.targets),
        "--optimizer": str(optimizer.kind), "--lr": f"{optimizer.lr:g}", "--momentum": f"{optimizer.momentum:g}",
        "--weight-decay": f"{optimizer.weight_decay:g}",
        "--layer-decay": None if optimizer.layer_decay is None else f"{optimizer.layer_decay:g}"}
    return {flag: "none" if value is None or value == "" else str(value) for flag, value in values.items()}


def describe_changes(changes: Sequence[Change]) -> str:
    """``image_size 32 -> 64 (--image-size), seed 0 -> 1 (--seed)``; a field whose flags are known names them:
    ``model: --lora-rank 8 -> 4``."""
    return ", ".join(str(c) if c.flags else f"{c} ({FIELD_FLAGS.get(c.name, c.name)})" for c in changes)


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
