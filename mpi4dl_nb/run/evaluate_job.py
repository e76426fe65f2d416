"""EvaluateJob: everything ``evaluate`` is asked, typed, as the schema of its flags and of ``dl.evaluate``'s keywords
(None: the checkpoint's setting), checked flag by flag as it is built; its check finds the checkpoint file, reads
the cohort, and tries the ``--slide-csv`` place before any rank talks (EvaluatePlan)."""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.files import CheckpointChoice
from ..comm.device import DeviceChoice
from ..config import DTYPE, PROGRESS, ParallelConfig
from ..data.apps import AppKind
from ..data.manifest import Cohort
from ..data.options import (
    APP,
    DATAPATH,
    IMAGE_SIZE,
    MIN_TISSUE,
    NUM_SAMPLES,
    REPAIR_ANNOTATIONS,
    SLIDE_LEVEL,
    STAIN_NORMALIZE,
    TASK,
    TISSUE,
    ImageSize,
)
from ..data.options import COHORT as COHORT_OPTION
from ..data.resolution import ResolutionChoice
from ..data.task import Task
from ..data.tissue_mask import TissueMethod
from ..errors import ConfigError
from ..evaluation.aggregate import Aggregation
from ..schema import build_job, check_bounds, flag
from . import flag_groups as groups
from .data_choice import COHORT
from .held_out_spec import HeldOutSpec
from .job_check import cohort_of
from .model_choice import ModelCheck
from .run_options import VERBOSE
from .training_spec import BATCH_SIZE, NUM_EPOCHS, SEED

COMMAND = "evaluate"
CHECKPOINTS = "the checkpoint's"      # what a setting left out of evaluate's flags takes
SLIDE_CSV = "--slide-csv"


@dataclass(frozen=True)
class EvaluateJob:
    """An evaluation of a checkpoint: the file, the layout, and what the flags give of the model it must hold, the
    data, the held-out images, batch, dtype and seed (None: the checkpoint's)."""

    source: CheckpointChoice
    config: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelCheck = field(default_factory=ModelCheck)
    app: AppKind | None = APP.field(None, default_text=CHECKPOINTS, group=groups.WORKLOAD)
    datapath: str | None = DATAPATH.field(None, group=groups.WORKLOAD)
    image_size: ImageSize | None = IMAGE_SIZE.field(None, default_text=CHECKPOINTS, group=groups.WORKLOAD)
    num_samples: int = NUM_SAMPLES.field(256, group=groups.RUN)
    slide_level: int | None = SLIDE_LEVEL.field(None, default_text="chosen by resolution", group=groups.RUN)
    resolution: ResolutionChoice = field(default_factory=ResolutionChoice)
    min_tissue: float = MIN_TISSUE.field(0.5, group=groups.RUN)
    tissue: TissueMethod = TISSUE.field(TissueMethod.SATURATION, group=groups.RUN)
    held_out: HeldOutSpec = field(default_factory=HeldOutSpec)
    all_data: bool = flag("--all-data", "evaluate every image of the data, not only the held-out ones", False,
                          switch=True, group=groups.RUN)
    batch_size: int | None = BATCH_SIZE.field(None, default_text=CHECKPOINTS)
    dtype: str | None = DTYPE.field(None, default_text=CHECKPOINTS, group=groups.RUN)
    seed: int | None = SEED.field(None, default_text=CHECKPOINTS)
    task: Task | None = TASK.field(None, default_text=CHECKPOINTS, group=groups.TASK)
    repair_annotations: bool = REPAIR_ANNOTATIONS.field(False, group=groups.TASK)
    cohort: str | None = COHORT_OPTION.field(None, group=groups.SLIDES)
    aggregate: Aggregation = flag("--aggregate", "a slide's probability per class from its tiles': their mean, max, "
                                                 "or the mean of the k highest (top-k: 5, or top-N); a patient's from "
                                                 "its slides' the same way", default_factory=Aggregation,
                                  parse=Aggregation.parse, metavar="mean|max|top-k", group=groups.SLIDES)
    slide_csv: str | None = flag(SLIDE_CSV, "write each slide's patient, label, prediction, tiles and class "
                                            "probabilities here", None, metavar="FILE.csv", group=groups.SLIDES)
    stain_normalize: bool = STAIN_NORMALIZE.field(True, group=groups.STAIN)
    progress: bool = PROGRESS.field(True, group=groups.RUN)
    placement: DeviceChoice = field(default_factory=DeviceChoice)
    # train's flags that evaluate accepts and has no use for (command lines written for train)
    verbose: bool = VERBOSE.field(False, hidden=True)
    num_epochs: int = NUM_EPOCHS.field(1, hidden=True)

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.held_out.val_datapath is not None and self.app is not None and not self.app.reads_datapath:
            raise ConfigError("--val-datapath", f"--app {self.app} reads no files; use --val-fraction")
        if self.cohort is not None and (self.datapath is not None or self.app not in (None, AppKind.MEDICAL)):
            raise ConfigError(COHORT, "gives the slides; drop --datapath/--app")
        if self.slide_level is not None and self.resolution.target is not None:
            raise ConfigError("--slide-level", "give --slide-level or --mpp/--magnification, not both")

    @classmethod
    def of(cls, **keywords: object) -> EvaluateJob:
        """The job ``evaluate`` would be given by the flags these keywords name (``checkpoint="ckpt"`` for
        ``--checkpoint ckpt``); ConfigError for a keyword no flag has."""
        return build_job(cls, keywords, COMMAND)

    def check(self) -> EvaluatePlan:
        """Before any rank talks: ``--slide-csv`` writable, the cohort read (every slide opened; its labels are
        checked against the checkpoint's classes once it is loaded), the device, the checkpoint file found."""
        if self.slide_csv is not None:
            check_writable(self.slide_csv, SLIDE_CSV)
        cohort = None if self.cohort is None else cohort_of(self.cohort, None, 1, 0)
        self.placement.check()
        return EvaluatePlan(self, str(self.source.path()), cohort)


@dataclass(frozen=True)
class EvaluatePlan:
    """A checked EvaluateJob: the checkpoint file it found and the cohort it read."""

    job: EvaluateJob
    checkpoint: str
    cohort: Cohort | None = None

    @property
    def config(self) -> ParallelConfig:
        return self.job.config


def check_writable(path: str, knob: str) -> None:
    """ConfigError naming ``knob`` unless a file can be written at ``path`` now (a file of its own is created and
    removed in its folder; an existing file is opened to append, nothing written)."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise ConfigError(knob, f"{path} is a folder; name a file in it (e.g. {target / 'slides.csv'})")
    folder = target.absolute().parent
    if not folder.is_dir():
        raise ConfigError(knob, f"{folder} is not a writable folder; choose another path")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".mpi4dl-write-check-"):
            pass
        if target.exists():
            with target.open("a"):
                pass
    except OSError as err:
        raise ConfigError(knob, f"cannot write {target}: {err.strerror or err}; choose a writable path") from None
