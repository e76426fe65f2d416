"""``train``'s checkpoint flags (CheckpointSpec: where, how often, which are kept, what the run resumes from) and run
options (RunOptions: device, data plane, progress, messages, failures, heap release, input read ahead), each checked on
construction."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..comm.allocator import RELEASE_EVERY_STEPS
from ..comm.determinism import DETERMINISTIC, Determinism
from ..comm.device import DeviceChoice
from ..config import PROGRESS
from ..errors import ConfigError
from ..evaluation.metrics import MetricName
from ..schema import Bounds, check_bounds, flag, number, option, whole_number
from . import flag_groups as groups
from .divergence import OnNonFinite
from .identity import parse_allowed

VERBOSE = option("--verbose", "print performance numbers and logs", switch=True, aliases=("-v",))


@dataclass(frozen=True)
class CheckpointSpec:
    """Where and how often checkpoints are written, which are kept, and what the run resumes from."""

    directory: str | None = flag("--checkpoint-dir", "write atomic checkpoints step-NNNNNNNN-<run>.pt (+ .json "
                                                     "manifest) here", None, group=groups.CHECKPOINTS)
    every: int = flag("--checkpoint-every", "checkpoint every N steps (0: at each epoch end and at the end)", 0,
                      parse=whole_number, bounds=Bounds(0), group=groups.CHECKPOINTS)
    keep: int = flag("--keep-checkpoints", "how many newest checkpoints of this run to keep", 2, parse=whole_number,
                     bounds=Bounds(1), group=groups.CHECKPOINTS)
    keep_best: MetricName | None = flag(
        "--keep-best", f"also keep the checkpoint of the best evaluation by METRIC ({', '.join(MetricName.values())}; "
                       f"lower val_loss, higher others is better) as best-step-*.pt, never rotated away", None,
        parse=MetricName, choices=MetricName.values(), metavar="METRIC", group=groups.CHECKPOINTS)
    early_stop: int | None = flag(
        "--early-stop", "stop once --keep-best's metric has not improved for N evaluations in a row (patience), the "
                        "best checkpoint kept; a final checkpoint of the step it stops at is written too", None,
        parse=whole_number, bounds=Bounds(1), metavar="N", group=groups.CHECKPOINTS)
    resume: str | None = flag("--resume", "continue from a checkpoint file, a directory, or 'latest' (in "
                                          "--checkpoint-dir): the newest intact one of this configuration", None,
                              group=groups.CHECKPOINTS)
    allow_config_change: tuple[str, ...] = flag(
        "--allow-config-change", "resume although these fields changed (comma-separated: model, dtype, image_size, "
                                 "batch_size, seed, app, data, lr, momentum, val_split, optimizer, lr_schedule, "
                                 "augment, class_weights, classes, stain, sampler, or all)", (), repeat=True,
        metavar="FIELDS", group=groups.CHECKPOINTS)

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.resume == "latest" and self.directory is None:
            raise ConfigError("--resume", "'latest' looks in --checkpoint-dir; give --checkpoint-dir or a checkpoint "
                                          "path")
        parse_allowed(self.allow_config_change)
        if self.keep_best is not None and self.directory is None:
            raise ConfigError("--keep-best", "keeps the best checkpoint in --checkpoint-dir: give one")
        if self.early_stop is not None and self.keep_best is None:
            raise ConfigError("--early-stop", "counts evaluations without a better --keep-best metric: give "
                                              "--keep-best METRIC too (e.g. --keep-best val_loss)")

    @property
    def path(self) -> Path | None:
        return None if self.directory is None else Path(self.directory)

    @property
    def allowed_changes(self) -> frozenset[str]:
        """The identity fields a resume may differ in (``--allow-config-change``)."""
        return parse_allowed(self.allow_config_change)


@dataclass(frozen=True)
class RunOptions:
    """How the run behaves on the ranks: the data plane and device, progress, messages, failures, heap release, input
    read ahead."""

    placement: DeviceChoice = field(default_factory=DeviceChoice)
    progress: bool = PROGRESS.field(True, group=groups.RUN)
    verbose: bool = VERBOSE.field(False, group=groups.WORKLOAD)
    on_nonfinite: OnNonFinite = flag("--on-nonfinite", "a NaN/inf loss or gradient stops the run (exit 3), or skips "
                                                       "that step", OnNonFinite.STOP, parse=OnNonFinite,
                                     choices=tuple(p.value for p in OnNonFinite), group=groups.RUN)
    step_timeout: float | None = flag("--step-timeout", "abort the job when a rank makes no progress for this long, "
                                                        "naming it (default: 10x the slowest of the first 3 steps, "
                                                        "at least 60 s; 0: off)", None, parse=number,
                                      metavar="SECONDS", bounds=Bounds(0), group=groups.RUN)
    release_heap_every: int = flag("--release-heap-every", "every N steps hand the heap's free pages back to the "
                                                           "kernel, so a rank's memory stays flat over days (0: never)",
                                   RELEASE_EVERY_STEPS, parse=whole_number, metavar="N", bounds=Bounds(0),
                                   group=groups.RUN)
    read_ahead: int = flag("--read-ahead", "read the input of the next N steps (regions, stain normalisation, "
                                           "augmentation) on a worker thread while a step computes; memory: N steps' "
                                           "input more (0: read inside the step)", 1, parse=whole_number,
                           metavar="N", bounds=Bounds(0), group=groups.RUN)
    determinism: Determinism = DETERMINISTIC.field(Determinism.AUTO, group=groups.RUN)

    def __post_init__(self) -> None:
        check_bounds(self)

    @property
    def backend(self) -> str:
        return self.placement.backend

    @property
    def device(self) -> str:
        return self.placement.device
