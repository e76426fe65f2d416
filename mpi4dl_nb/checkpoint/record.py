"""RunRecord: what a training run stores in its checkpoints (model, layout, data, seed, position), read back typed.

The one place that knows a checkpoint's payload: ``write_checkpoint`` puts a run's record and
its tensors into a file (``files.py`` makes the write atomic and checksummed), ``read_checkpoint``
gives them back typed. Training writes; resume, evaluate and infer read through here only.
Files of format 2 (the run's flags as a flat ``"run"`` dict) and format 1 (no run id, no
identity) still read: their fields are mapped onto the record, nothing is lost.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..data.apps import AppKind
from ..data.augment import AugmentSpec
from ..data.canvas import CanvasPlacement
from ..data.classes import numbered
from ..data.stain import StainNormalizer
from ..data.task import Task
from ..loss import ClassCrossEntropy, DenseLoss, LossKind
from ..models.spec import ModelFamily, ModelSpec, optional_whole, whole
from ..pipeline.layer_decay import RateGroup
from ..pipeline.optim import LRSchedule, OptimizerSpec
from . import files
from .files import FORMAT_VERSION, BestMark, save_checkpoint

RECORD_KEY = "record"          # format 3: RunRecord.to_payload()'s section
LEGACY_KEY = "run"             # formats 1-2: the run's flags, flat
MODEL_STATE = "model"          # whole-model state dict (parameter and buffer names of the layer list)
OPTIMIZER_STATE = "optimizer"  # per parameter name: its optimizer state (OptimizerState)
LEGACY_IDENTITY = ("image_size", "batch_size", "app", "dtype")   # what format 1 files identify a run by
WRITTEN_BY = "use a checkpoint written by 'python -m mpi4dl_nb train --checkpoint-dir'"

OptimizerState = dict[str, dict[str, object]]
VolumeSize = tuple[int, int, int]          # (D, H, W) voxels, or a tile grid's (depth, rows, cols)
VoxelSize = tuple[float, float, float]     # µm along (z, y, x)


@dataclass(frozen=True)
class DataRecord:
    """The data a run trained on, as its flags named it (``datapath``: None for generated data or unknown)."""

    app: AppKind
    image_size: int
    batch_size: int
    dtype: str = "float32"
    datapath: str | None = None
    val_fraction: float | None = None
    val_datapath: str | None = None
    classes: tuple[str, ...] | None = None      # the class names in label order (None: not recorded)
    mpp: float | None = None                    # µm per pixel the run trained at (None: unknown)
    cohort: str | None = None                   # --cohort: the manifest's path (None: none)
    whole_slide: bool = False                   # --whole-slide: a sample per slide (its tissue on a canvas)
    canvases: tuple[CanvasPlacement, ...] = ()  # --whole-slide: where each slide's canvas lay
    volume_size: VolumeSize | None = None       # volumes: the patch's (D, H, W) voxels (None: images, or unknown)
    voxel_size: VoxelSize | None = None         # volumes: --voxel-size (z, y, x) µm read at (None: as stored)
    volume_grid: VolumeSize | None = None       # volumes: the tile grid's (depth, rows, cols) (None: not tiled)

    @property
    def size_text(self) -> str:
        """``--image-size`` as given: ``N`` for images, ``D,H,W`` for a volume's patch."""
        return str(self.image_size) if self.volume_size is None else ",".join(map(str, self.volume_size))

    def to_dict(self) -> dict[str, object]:
        return {"app": str(self.app), "image_size": self.image_size, "batch_size": self.batch_size,
                "dtype": self.dtype, "datapath": self.datapath, "val_fraction": self.val_fraction,
                "val_datapath": self.val_datapath, "classes": None if self.classes is None else list(self.classes),
                "mpp": self.mpp, "cohort": self.cohort, "whole_slide": self.whole_slide,
                "canvases": [c.to_dict() for c in self.canvases],
                "volume_size": None if self.volume_size is None else list(self.volume_size),
                "voxel_size": None if self.voxel_size is None else list(self.voxel_size),
                "volume_grid": None if self.volume_grid is None else list(self.volume_grid)}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> DataRecord:
        """The data ``to_dict`` (or a format-2 ``run`` dict) stored; ValueError naming a bad field."""
        return cls(AppKind.parse(text(data, "app", "synthetic")), whole(data, "image_size"),
                   whole(data, "batch_size"), text(data, "dtype", "float32"), optional_text(data, "datapath"),
                   optional_number(data, "val_fraction"), optional_text(data, "val_datapath"),
                   optional_names(data, "classes"), optional_number(data, "mpp"), optional_text(data, "cohort"),
                   data.get("whole_slide") is True, canvases_of(data.get("canvases", [])),
                   optional_sides(data, "volume_size"), optional_sizes(data, "voxel_size"),
                   optional_sides(data, "volume_grid"))


def canvases_of(value: object) -> tuple[CanvasPlacement, ...]:
    """The canvases a record lists; ValueError for another shape."""
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise ValueError(f"checkpoint record field 'canvases' must be a list of objects, got {value!r}")
    return tuple(CanvasPlacement.from_dict(item) for item in value)


@dataclass(frozen=True)
class SplitRecord:
    """A held-out split as made: how its images were grouped (patient, slide, or ungrouped), its seed and share or
    fold, and the groups on each side (the keys ``train`` and ``val`` of its dict)."""

    grouping: str
    seed: int
    train: tuple[str, ...]
    val: tuple[str, ...]
    fraction: float | None = None
    folds: int | None = None
    fold: int | None = None
    group_by: str | None = None                  # --group-by's regex (None: default patterns)

    def to_dict(self) -> dict[str, object]:
        return {"grouping": self.grouping, "seed": self.seed, "fraction": self.fraction, "folds": self.folds,
                "fold": self.fold, "group_by": self.group_by, "train": list(self.train), "val": list(self.val)}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> SplitRecord:
        """The split ``to_dict`` stored; ValueError naming a bad field."""
        return cls(text(data, "grouping", "ungrouped"), whole(data, "seed", 0), optional_names(data, "train") or (),
                   optional_names(data, "val") or (), optional_number(data, "fraction"),
                   optional_whole(data, "folds"), optional_whole(data, "fold"), optional_text(data, "group_by"))


@dataclass(frozen=True)
class TrainingRecord:
    """How a run trains: optimizer, learning-rate schedule, augmentation, class weights (None: unweighted)."""

    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    schedule: LRSchedule = field(default_factory=LRSchedule)
    augment: AugmentSpec = field(default_factory=AugmentSpec)
    class_weights: tuple[float, ...] | None = None

    def to_dict(self) -> dict[str, object]:
        return {"optimizer": self.optimizer.to_dict(), "schedule": self.schedule.to_dict(),
                "augment": self.augment.to_dict(),
                "class_weights": None if self.class_weights is None else list(self.class_weights)}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> TrainingRecord:
        """The settings ``to_dict`` stored; ValueError naming a bad field."""
        weights = data.get("class_weights")
        if weights is not None and (not isinstance(weights, list) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)):
            raise ValueError(f"field 'class_weights': expected a list of numbers, got {weights!r}")
        return cls(OptimizerSpec.from_dict(section(data, "optimizer")), LRSchedule.from_dict(section(data, "schedule")),
                   AugmentSpec.from_dict(section(data, "augment")),
                   None if weights is None else tuple(float(w) for w in weights))


@dataclass(frozen=True)
class SegmentationRecord:
    """How a segmentation run counts its pixels: the loss (``ce``, ``dice``, ``ce+dice``; class weights in
    ``TrainingRecord``) and the mask value no pixel is scored at (None: every pixel scored)."""

    loss: str = "ce"
    ignore_index: int | None = None

    def to_dict(self) -> dict[str, object]:
        return {"loss": self.loss, "ignore_index": self.ignore_index}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> SegmentationRecord:
        """The settings ``to_dict`` stored; ValueError naming a bad field."""
        return cls(text(data, "loss", "ce"), optional_whole(data, "ignore_index"))


@dataclass(frozen=True)
class RunRecord:
    """What a training run is and where it stands: written into each checkpoint, read by resume/evaluate/infer.

    ``config`` is the writing run's ``ParallelConfig.as_dict()`` (a checkpoint resumes on any
    layout; it says where it came from). ``identity`` holds the fields a resume compares
    (``run/identity.py``), ``step`` the optimizer steps done, ``run_id`` the lineage. ``training``
    (None: written before it was recorded) how it trains, ``best`` the best evaluation so far
    of a run with ``--keep-best`` (None: none yet, or not kept). ``task``: what the model predicts (one class
    per image, or per pixel); a segmentation run's pixel settings in ``segmentation``.
    """

    model: ModelSpec
    data: DataRecord
    seed: int = 0
    config: Mapping[str, object] = field(default_factory=dict)
    step: int = 0
    run_id: str | None = None
    identity: Mapping[str, object] = field(default_factory=dict)
    training: TrainingRecord | None = None
    best: BestMark | None = None
    task: Task = Task.CLASSIFICATION
    segmentation: SegmentationRecord | None = None
    split: SplitRecord | None = None             # the held-out split with the groups of each side (None: none)
    stain: StainNormalizer | None = None         # the stain normaliser every image was read through (None: none)
    param_groups: tuple[RateGroup, ...] = ()     # the optimizer's groups at ``step``, each lr and lr_scale (): older

    def at(self, step: int, run_id: str) -> RunRecord:
        """This record after ``step`` optimizer steps of lineage ``run_id``."""
        return replace(self, step=step, run_id=run_id)

    @property
    def class_names(self) -> tuple[str, ...]:
        """The model's class names in output order: the recorded ones, else ``0``, ``1``, ..."""
        if self.data.classes is not None and len(self.data.classes) == self.model.num_classes:
            return self.data.classes
        return numbered(self.model.num_classes)

    def loss(self) -> ClassCrossEntropy | DenseLoss:
        """The loss the run trains with, and its evaluations score with: cross-entropy of a class per image, or the
        segmentation loss per pixel (its kind and ignore index), with the run's class weights."""
        weights = self.training.class_weights if self.training is not None else None
        if not self.task.dense:
            return ClassCrossEntropy(weights)
        pixels = self.segmentation or SegmentationRecord()
        return DenseLoss(LossKind(pixels.loss), weights, pixels.ignore_index)

    def summary_fields(self) -> dict[str, object]:
        """The flat fields a training summary starts with (what format 2 stored as ``run``)."""
        model, data = self.model, self.data
        return {"model": model.label, "resnet_version": model.resnet_version,
                "num_layers": model.num_layers, "num_filters": model.num_filters,
                "num_classes": model.num_classes, "image_size": data.image_size, "batch_size": data.batch_size,
                "app": str(data.app), "dtype": data.dtype, "val_fraction": data.val_fraction,
                "val_datapath": data.val_datapath, "classes": list(self.class_names), "task": str(self.task),
                **({} if data.volume_size is None else {"volume_size": list(data.volume_size)})}

    def to_payload(self) -> dict[str, object]:
        """The record's entries of a checkpoint payload: plain values only (the file loads with ``weights_only``)."""
        return {RECORD_KEY: {"model": self.model.to_dict(), "data": self.data.to_dict(), "seed": self.seed,
                             "config": dict(self.config),
                             "training": None if self.training is None else self.training.to_dict(),
                             "best": None if self.best is None else self.best.to_dict(), "task": str(self.task),
                             "segmentation": None if self.segmentation is None else self.segmentation.to_dict(),
                             "split": None if self.split is None else self.split.to_dict(),
                             "stain": None if self.stain is None else self.stain.to_dict(),
                             "param_groups": [group.to_dict() for group in self.param_groups]},
                "step": self.step, "run_id": self.run_id, "identity": dict(self.identity),
                "format_version": FORMAT_VERSION}

    @classmethod
    def from_payload(cls, data: Mapping[str, object], path: str | Path) -> RunRecord:
        """The record of a loaded checkpoint (any format); ValueError for a file that is not a checkpoint of
        ours or lacks a model description."""
        if "step" not in data or "format_version" not in data:
            raise ValueError(f"{path} is not an mpi4dl_nb checkpoint (no step/format_version)")
        record, legacy = data.get(RECORD_KEY), data.get(LEGACY_KEY)
        try:
            if isinstance(record, Mapping):
                training, best, pixels = record.get("training"), record.get("best"), record.get("segmentation")
                split, stain = record.get("split"), record.get("stain")
                return cls(ModelSpec.from_dict(section(record, "model")), DataRecord.from_dict(section(record, "data")),
                           whole(record, "seed", 0), section(record, "config"), whole(data, "step"),
                           optional_text(data, "run_id"), section(data, "identity"),
                           None if training is None else TrainingRecord.from_dict(section(record, "training")),
                           None if best is None else BestMark.from_dict(section(record, "best")),
                           Task.parse(text(record, "task", Task.CLASSIFICATION.value)),
                           None if pixels is None else SegmentationRecord.from_dict(section(record, "segmentation")),
                           None if split is None else SplitRecord.from_dict(section(record, "split")),
                           None if stain is None else StainNormalizer.from_dict(section(record, "stain")),
                           param_groups_of(record))
            if isinstance(legacy, Mapping) and "model" in legacy:
                return cls.from_legacy(legacy, data)
        except ValueError as err:
            raise ValueError(f"checkpoint {path}: incomplete run record ({err}); {WRITTEN_BY}") from err
        raise ValueError(f"checkpoint {path} holds no model description; {WRITTEN_BY}")

    @classmethod
    def from_legacy(cls, run: Mapping[str, object], data: Mapping[str, object]) -> RunRecord:
        """A format 1-2 checkpoint: ``run`` (the flags, flat) beside ``data_seed``, ``config``, ``batch_size``."""
        model = ModelSpec(ModelFamily.parse(text(run, "model")), whole(run, "num_layers"), whole(run, "num_filters"),
                          whole(run, "num_classes"), optional_whole(run, "resnet_version"))
        flags = dict(run)
        flags.setdefault("batch_size", data.get("batch_size"))
        identity = section(data, "identity")
        if whole(data, "format_version") < 2:
            identity = {k: run[k] for k in LEGACY_IDENTITY if k in run}
            if "data_seed" in data:
                identity["seed"] = data["data_seed"]
        seed = optional_whole(data, "data_seed")
        if seed is None:
            seed = optional_whole(identity, "seed")
        return cls(model, DataRecord.from_dict(flags), seed or 0, section(data, "config"), whole(data, "step"),
                   optional_text(data, "run_id"), identity)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint read back: where it is, its record, the model's tensors and the optimizer's state."""

    path: Path
    record: RunRecord
    model_state: dict[str, torch.Tensor]
    optimizer_state: OptimizerState | None


def write_checkpoint(directory: str | Path, record: RunRecord, model_state: Mapping[str, torch.Tensor],
                     optimizer_state: OptimizerState | None, *, keep: int = 2, best: bool = False) -> Path:
    """Write checkpoint ``record.step`` of lineage ``record.run_id`` (see ``files.save_checkpoint``); ``best``:
    as the run's best checkpoint, marked with ``record.best``."""
    if record.run_id is None:
        raise ValueError("a checkpoint is written with a run id (RunRecord.at(step, run_id))")
    if best and record.best is None:
        raise ValueError("a best checkpoint is written with the record's best mark (RunRecord.best)")
    payload = {**record.to_payload(), MODEL_STATE: dict(model_state), OPTIMIZER_STATE: optimizer_state}
    return save_checkpoint(directory, record.step, payload, run_id=record.run_id, identity=record.identity,
                           keep=keep, best=record.best if best else None)


def read_checkpoint(path: str | Path, *, lazy: bool = False, check: bool = True) -> LoadedCheckpoint:
    """Load and check a checkpoint (``files.load_checkpoint``) and read its record; ValueError saying what is wrong."""
    file = Path(path)
    data = files.load_checkpoint(file, lazy=lazy, check=check)   # looked up on the module: tests replace it
    record = RunRecord.from_payload(data, file)
    model = data.get(MODEL_STATE)
    if not isinstance(model, dict) or not all(isinstance(v, torch.Tensor) for v in model.values()):
        raise ValueError(f"checkpoint {file} holds no model weights; {WRITTEN_BY}")
    optimizer = data.get(OPTIMIZER_STATE)
    return LoadedCheckpoint(file, record, model, optimizer if isinstance(optimizer, dict) else None)


def param_groups_of(record: Mapping[str, object]) -> tuple[RateGroup, ...]:
    """The optimizer's groups a record lists (none when missing: written before they were recorded); ValueError for
    another shape."""
    value = record.get("param_groups")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(item, Mapping) for item in value):
        raise ValueError(f"field 'param_groups': expected a list of objects, got {value!r}")
    return tuple(RateGroup.from_dict(item) for item in value)


# ----------------------------------------------------------------- typed fields
def section(data: Mapping[str, object], key: str) -> dict[str, object]:
    """``data[key]`` as a dict with string keys (empty when missing); ValueError for another type."""
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"field {key!r}: expected a mapping, got {type(value).__name__}")
    return dict(value)


def optional_text(data: Mapping[str, object], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"field {key!r}: expected text, got {value!r}")
    return value


def text(data: Mapping[str, object], key: str, default: str | None = None) -> str:
    value = optional_text(data, key)
    if value is None:
        value = default
    if value is None:
        raise ValueError(f"field {key!r} is missing")
    return value


def optional_names(data: Mapping[str, object], key: str) -> tuple[str, ...] | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"field {key!r}: expected a list of names, got {value!r}")
    return tuple(value)


def optional_sides(data: Mapping[str, object], key: str) -> tuple[int, int, int] | None:
    """``data[key]`` as three whole numbers (None when missing: written before volumes recorded it); ValueError
    for another shape."""
    value = three(data, key)
    if value is not None and not all(isinstance(v, int) for v in value):
        raise ValueError(f"field {key!r}: expected three whole numbers, got {value!r}")
    return None if value is None else (int(value[0]), int(value[1]), int(value[2]))


def optional_sizes(data: Mapping[str, object], key: str) -> tuple[float, float, float] | None:
    """``data[key]`` as three numbers (None when missing); ValueError for another shape."""
    value = three(data, key)
    return None if value is None else (float(value[0]), float(value[1]), float(value[2]))


def three(data: Mapping[str, object], key: str) -> list[int | float] | None:
    """``data[key]`` as a list of three numbers (None when missing); ValueError for another shape."""
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 3 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise ValueError(f"field {key!r}: expected a list of three numbers, got {value!r}")
    return list(value)


def optional_number(data: Mapping[str, object], key: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"field {key!r}: expected a number, got {value!r}")
    return float(value)
