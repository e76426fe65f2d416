"""TrainJob: everything ``train`` is asked, typed, as the schema of its flags and of ``dl.train``'s keywords (each
field names its flag), checked flag by flag as it is built; its check reads the data once and gives the TrainPlan
the runner runs (``run/job_run.py``): the network and data resolved against what it read. DataSpec: the images a
run reads, resolved (train and evaluate)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..checkpoint.record import DataRecord, RunRecord, SegmentationRecord
from ..config import ParallelConfig
from ..data.apps import AppKind
from ..data.manifest import Cohort
from ..data.stain import StainNormalizer, StainRequest
from ..data.task import Task
from ..data.tissue_mask import TissueMethod
from ..models.spec import ModelSpec
from ..schema import build_job
from .data_choice import DataChoice
from .flag_checks import check_train_flags
from .held_out_spec import ValidationSpec
from .job_check import DataFound, read_data
from .model_choice import ModelChoice
from .run_options import CheckpointSpec, RunOptions
from .training_spec import TrainingSpec

COMMAND = "train"


@dataclass(frozen=True)
class DataSpec:
    """The images a run reads (``--app``, ``--datapath``), at which size and resolution, with which classes."""

    app: AppKind = AppKind.SYNTHETIC
    datapath: str | None = None
    image_size: int = 32                 # the image side (volumes: the patch's largest side)
    num_samples: int = 256               # generated images
    slide_level: int = 0
    min_tissue: float = 0.5
    tissue: TissueMethod = TissueMethod.SATURATION   # what counts as tissue on a slide's overview (--tissue)
    repair_annotations: bool = False     # annotated slides: invalid polygons repaired, not refused
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

    @classmethod
    def of(cls, data: DataChoice, found: DataFound, tissue_pool: bool) -> DataSpec:
        """The images ``data``'s flags name, with what the check found of them (``tissue_pool``: a head pooling
        over the tissue mask, which whole-slide canvases then carry)."""
        volume = data.image_size if isinstance(data.image_size, tuple) else None
        return cls(app=data.reads, datapath=data.datapath, image_size=data.side, num_samples=data.num_samples,
                   slide_level=data.slide_level, min_tissue=data.min_tissue, tissue=data.tissue,
                   repair_annotations=data.repair_annotations, mpp=data.resolution.target,
                   source_mpp=data.resolution.source_mpp, volume_size=volume, voxel_size=data.voxel_size,
                   num_classes=len(found.class_names), class_names=found.class_names, class_order=found.class_order,
                   task=data.task, ignore_index=data.ignore_index, skip_bad_files=data.skip_bad_files,
                   cohort=found.cohort, whole_slide=data.whole_slide, tissue_channel=data.whole_slide and tissue_pool,
                   stain_request=found.stain_request)


@dataclass(frozen=True)
class TrainJob:
    """A training run as asked: the layout, the network, its data and held-out images, how it trains, checkpoints
    and run options; every field is a flag of ``train`` (or a group of them) and a keyword of ``dl.train``."""

    config: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelChoice = field(default_factory=ModelChoice)
    data: DataChoice = field(default_factory=DataChoice)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    held_out: ValidationSpec = field(default_factory=ValidationSpec)
    checkpoints: CheckpointSpec = field(default_factory=CheckpointSpec)
    options: RunOptions = field(default_factory=RunOptions)

    def __post_init__(self) -> None:
        check_train_flags(self)

    @classmethod
    def of(cls, **keywords: object) -> TrainJob:
        """The job ``train`` would be given by the flags these keywords name (``num_layers=8`` for
        ``--num-layers 8``): the same defaults and checks; ConfigError for a keyword no flag has."""
        return build_job(cls, keywords, COMMAND)

    def check(self) -> TrainPlan:
        """The job against its device and data, read once, before any rank talks (ConfigError naming the flag and
        the fix): the plan the runner runs, holding what was read."""
        self.options.placement.check()
        found = read_data(self)
        side = self.data.image_size if isinstance(self.data.image_size, int) else None
        model = self.model.spec(len(found.class_names), found.in_channels, side if self.model.family.named else None)
        return TrainPlan(self.config, model, DataSpec.of(self.data, found, model.pool.tissue), self.training,
                         self.held_out, self.checkpoints, self.options, asked=self)


@dataclass(frozen=True)
class TrainPlan:
    """A checked TrainJob: its layout, training, held-out, checkpoint and run settings, with the network and the
    data resolved against what its check read (classes, cohort, stain request, channels). ``run/job_run.py`` runs
    it, from the command line and ``dl.train`` alike."""

    config: ParallelConfig
    model: ModelSpec
    data: DataSpec = field(default_factory=DataSpec)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    held_out: ValidationSpec = field(default_factory=ValidationSpec)
    checkpoints: CheckpointSpec = field(default_factory=CheckpointSpec)
    options: RunOptions = field(default_factory=RunOptions)
    asked: TrainJob | None = field(default=None, compare=False, repr=False)   # its flags: the run's config.toml

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


def data_text(data: DataSpec) -> str:
    """What opening the data does, for a set-up line: the cohort's or folder's path, or the app without one."""
    source = data.cohort or data.datapath
    if source is None:
        return f"opening the {data.app} data (no --datapath)"
    return f"reading the data in {source}" + (" (finding each slide's canvas)" if data.whole_slide else "")
