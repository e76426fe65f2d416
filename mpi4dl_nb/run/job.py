"""TrainJob and EvaluateJob: everything a training or an evaluation run needs, typed, built once at the edge (from
the command's flags or from Python keyword arguments, ``cli/train_job.py``) and read by the run alone."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint.record import DataRecord, RunRecord, SegmentationRecord, TrainingRecord
from ..config import ParallelConfig
from ..data.apps import AppKind
from ..data.augment import AugmentSpec
from ..data.classes import class_weights
from ..data.manifest import Cohort
from ..data.stain import StainNormalizer, StainRequest
from ..data.task import Task
from ..evaluation.aggregate import Aggregation
from ..evaluation.metrics import MetricName
from ..models.spec import ModelSpec
from ..pipeline.optim import DEFAULT_GAMMA, LRSchedule, LRScheduleKind, OptimizerSpec
from ..spatial.loss import LossKind
from .divergence import OnNonFinite

ClassWeights = tuple[float, ...] | str | None      # one weight per class, "balanced" (from the counts), or none


@dataclass(frozen=True)
class DataSpec:
    """The images a run reads (``--app``, ``--datapath``), at which size and resolution, with which classes."""

    app: AppKind = AppKind.SYNTHETIC
    datapath: str | None = None
    image_size: int = 32                 # the image side (volumes: the patch's largest side)
    num_samples: int = 256               # generated images
    slide_level: int = 0
    min_tissue: float = 0.5
    mpp: float | None = None             # µm per pixel to read at (--mpp or --magnification; None: as stored)
    source_mpp: float | None = None      # level 0's µm per pixel, given
    volume_size: tuple[int, int, int] | None = None        # volumes: the patch's (D, H, W) voxels (None: images)
    voxel_size: tuple[float, float, float] | None = None   # volumes: µm (z, y, x) to read at (None: as stored)
    num_classes: int = 10
    class_names: tuple[str, ...] = ()
    class_order: tuple[str, ...] | None = None    # the names ordering class folders' labels (None: other data)
    task: Task = Task.CLASSIFICATION
    ignore_index: int | None = None      # segmentation: the mask value no pixel is scored at
    skip_bad_files: bool = False         # train on the usable files when the data check finds bad ones
    cohort: Cohort | None = None         # --cohort: the checked manifest (its slides, labels, patients)
    whole_slide: bool = False            # --whole-slide: a sample per slide, its tissue on one canvas
    tissue_channel: bool = False         # canvases carry their tissue mask as a last channel (--pool tissue-mean)
    stain_request: StainRequest | None = None    # --stain-normalize/--stain-reference (fitted once, on rank 0)
    stain: StainNormalizer | None = None         # the fitted normaliser every image is read through (None: none)


@dataclass(frozen=True)
class HeldOutSpec:
    """The held-out images (a seeded share of the data, or another folder), when to evaluate, where to log."""

    val_fraction: float | None = None
    val_datapath: str | None = None
    eval_every: int = 0
    log_dir: str | None = None
    group_by: str | None = None          # --group-by REGEX: tile file names' slide (None: default patterns)
    folds: int | None = None             # --folds K: grouped stratified K-fold
    fold: int | None = None              # --fold I: the fold held out (None with folds: every fold in turn)

    @property
    def given(self) -> bool:
        return self.val_fraction is not None or self.val_datapath is not None or self.folds is not None

    @property
    def every_fold(self) -> bool:
        """``--folds K`` without ``--fold``: K runs, fold by fold."""
        return self.folds is not None and self.fold is None


@dataclass(frozen=True)
class TrainingSpec:
    """How the run trains: batches, length, seed, dtype, optimizer and schedule, class weights, augmentation."""

    batch_size: int = 32
    steps: int | None = None             # None: num_epochs x batches per epoch
    num_epochs: int = 1
    seed: int = 0
    dtype: str = "float32"
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    lr_schedule: LRScheduleKind = LRScheduleKind.CONSTANT
    warmup_steps: int = 0
    lr_step_size: int | None = None
    lr_gamma: float = DEFAULT_GAMMA
    class_weights: ClassWeights = None
    augment: AugmentSpec = field(default_factory=AugmentSpec)
    loss: LossKind = LossKind.CE         # segmentation's per-pixel loss
    accumulate: int = 1                  # batches per optimizer step (gradient accumulation, --accumulate)

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
        return TrainingRecord(self.optimizer, self.schedule(steps), self.augment, weights)


@dataclass(frozen=True)
class CheckpointSpec:
    """Where and how often checkpoints are written, which are kept, and what the run resumes from."""

    directory: str | None = None
    every: int = 0                       # 0: at each epoch end and at the end
    keep: int = 2
    keep_best: MetricName | None = None
    resume: str | None = None            # a file, a directory, or "latest"
    allow_config_change: frozenset[str] = frozenset()

    @property
    def path(self) -> Path | None:
        return None if self.directory is None else Path(self.directory)


@dataclass(frozen=True)
class RunOptions:
    """How the run behaves on the ranks: the data plane and device, progress, messages, failures."""

    backend: str = "auto"
    device: str = "auto"
    progress: bool = True
    verbose: bool = False
    on_nonfinite: OnNonFinite = OnNonFinite.STOP
    step_timeout: float | None = None    # None: derived from the first steps; 0: off


@dataclass(frozen=True)
class TrainJob:
    """A training run, whole: the layout, the network, its data and held-out images, how it trains,
    checkpoints and run options. Built once (``cli/train_job.py``); ``run/job_run.py`` runs it."""

    config: ParallelConfig
    model: ModelSpec
    data: DataSpec = field(default_factory=DataSpec)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    held_out: HeldOutSpec = field(default_factory=HeldOutSpec)
    checkpoints: CheckpointSpec = field(default_factory=CheckpointSpec)
    options: RunOptions = field(default_factory=RunOptions)

    def record(self) -> RunRecord:
        """What the run is, as its checkpoints store it and its JSON summary begins (the data's resolution, how
        it trains and its identity come once the data is open)."""
        data, training = self.data, self.training
        record = DataRecord(data.app, data.image_size, training.batch_size, training.dtype, data.datapath,
                            self.held_out.val_fraction, self.held_out.val_datapath, data.class_names or None,
                            cohort=None if data.cohort is None else str(data.cohort.source),
                            whole_slide=data.whole_slide)
        pixels = SegmentationRecord(str(training.loss), data.ignore_index) if data.task.dense else None
        return RunRecord(self.model, record, seed=training.seed, config=self.config.as_dict(), task=data.task,
                         segmentation=pixels, stain=data.stain)

    def task_identity(self) -> dict[str, object]:
        """The run identity's task fields: the task, and a segmentation run's loss."""
        found: dict[str, object] = {"task": str(self.data.task)}
        if self.data.task.dense:
            found["loss"] = f"{self.training.loss}, ignore {self.data.ignore_index}"
        return found


@dataclass(frozen=True)
class EvaluateJob:
    """An evaluation of a checkpoint: the file, the layout, and what the flags give of the data, the held-out
    images, batch, dtype and seed (None: the checkpoint's; ``cli/evaluate_cmd.py`` resolves them against its
    record)."""

    checkpoint: str
    config: ParallelConfig
    checkpoint_select: str = "latest"
    app: AppKind | None = None
    datapath: str | None = None
    image_size: int | None = None
    num_samples: int = 256
    slide_level: int | None = None
    mpp: float | None = None             # --mpp or --magnification
    source_mpp: float | None = None
    min_tissue: float = 0.5
    held_out: HeldOutSpec = field(default_factory=HeldOutSpec)
    all_data: bool = False
    batch_size: int | None = None
    dtype: str | None = None
    seed: int | None = None
    task: Task | None = None             # refuse a checkpoint of the other task (None: the checkpoint's)
    model: str | None = None             # refuse a checkpoint of another network
    model_flags: tuple[tuple[str, str, object], ...] = ()   # (flag, ModelSpec field, value given): must match
    options: RunOptions = field(default_factory=RunOptions)
    cohort: Cohort | None = None         # --cohort: the slides to evaluate (labels checked once the model is known)
    aggregate: Aggregation = field(default_factory=Aggregation)    # slide/patient level: how tiles aggregate
    slide_csv: str | None = None         # --slide-csv: the per-slide table
    stain_normalize: bool = True         # read through the checkpoint's stain normaliser (--no-stain-normalize)
