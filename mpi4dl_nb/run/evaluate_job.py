"""EvaluateJob: everything ``evaluate`` is asked, typed, as the schema of its flags and of ``dl.evaluate``'s keywords
(None: the checkpoint's setting), checked flag by flag as it is built; its check finds the checkpoint file, reads
the cohort, and tries the ``--slide-csv`` place before any rank talks (EvaluatePlan)."""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.files import CheckpointChoice
from ..comm.device import DeviceChoice
from ..config import ParallelConfig
from ..data.apps import AppKind
from ..data.manifest import Cohort
from ..data.resolution import ResolutionChoice
from ..data.task import Task
from ..errors import ConfigError
from ..evaluation.aggregate import Aggregation
from ..schema import Bounds, build_job, check_bounds, flag, whole_number
from . import flag_groups as groups
from .data_choice import (
    COHORT,
    ImageSize,
    app_flag,
    cohort_flag,
    datapath_flag,
    image_size_flag,
    min_tissue_flag,
    samples_flag,
    task_flag,
)
from .held_out_spec import HeldOutSpec
from .job_check import cohort_of
from .model_choice import ModelCheck
from .training_spec import dtype_flag

COMMAND = "evaluate"
SLIDE_CSV = "--slide-csv"


@dataclass(frozen=True)
class EvaluateJob:
    """An evaluation of a checkpoint: the file, the layout, and what the flags give of the model it must hold, the
    data, the held-out images, batch, dtype and seed (None: the checkpoint's)."""

    source: CheckpointChoice
    config: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelCheck = field(default_factory=ModelCheck)
    app: AppKind | None = app_flag(None)
    datapath: str | None = datapath_flag()
    image_size: ImageSize | None = image_size_flag(None)
    num_samples: int = samples_flag()
    slide_level: int | None = flag("--slide-level", "pyramid level to read as it is (default: chosen by resolution; "
                                                    "not with --mpp)", None, parse=whole_number, bounds=Bounds(0),
                                   group=groups.RUN)
    resolution: ResolutionChoice = field(default_factory=ResolutionChoice)
    min_tissue: float = min_tissue_flag()
    held_out: HeldOutSpec = field(default_factory=HeldOutSpec)
    all_data: bool = flag("--all-data", "evaluate every image of the data, not only the held-out ones", False,
                          switch=True, group=groups.RUN)
    batch_size: int | None = flag("--batch-size", "global batch size (default: the checkpoint's)", None,
                                  parse=whole_number, bounds=Bounds(1), group=groups.WORKLOAD)
    dtype: str | None = dtype_flag(None, "default: the checkpoint's")
    seed: int | None = flag("--seed", "seed of the --val-fraction split (default: the checkpoint's)", None,
                            parse=whole_number, bounds=Bounds(0), group=groups.RUN)
    task: Task | None = task_flag(None, "; refuse a checkpoint of the other task (default: the checkpoint's)")
    cohort: str | None = cohort_flag()
    aggregate: Aggregation = flag("--aggregate", "a slide's probability per class from its tiles': their mean, max, "
                                                 "or the mean of the k highest (top-k: 5, or top-N); a patient's from "
                                                 "its slides' the same way", default_factory=Aggregation,
                                  parse=Aggregation.parse, metavar="mean|max|top-k", group=groups.SLIDES)
    slide_csv: str | None = flag(SLIDE_CSV, "write each slide's patient, label, prediction, tiles and class "
                                            "probabilities here", None, metavar="FILE.csv", group=groups.SLIDES)
    stain_normalize: bool = flag("--no-stain-normalize", "read the images as stored, not through the stain "
                                                         "normaliser the checkpoint records (by default they are "
                                                         "read as the training run read them)", True, switch=True,
                                 group=groups.STAIN)
    placement: DeviceChoice = field(default_factory=DeviceChoice)
    # train's flags that evaluate accepts and has no use for (command lines written for train)
    verbose: bool = flag("--verbose", "accepted as train takes it", False, switch=True, aliases=("-v",), hidden=True)
    num_epochs: int = flag("--num-epochs", "accepted as train takes it", 1, parse=whole_number, hidden=True)

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
