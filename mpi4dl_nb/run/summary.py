"""What a training run reports: each rank's figures, the latest evaluation, and the run's one-line JSON summary."""
from __future__ import annotations

import json
import math
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..checkpoint.files import BestMark
from ..checkpoint.record import RunRecord
from ..evaluation.metrics import Metrics
from ..evaluation.pixel_metrics import SegmentationMetrics


def config_as_run(knobs: Mapping[str, object]) -> dict[str, object]:
    """A configuration's knobs (``ParallelConfig.as_dict``) as the run used them: without a spatial stage no tile
    layout (``slice_method`` None, one part); a volume's tiles as their DxRxC grid, a grid given as rows x cols by
    that grid alone (``slice_method`` None)."""
    ran = dict(knobs)
    volume, grid = ran.get("volume_grid"), ran.get("grid")
    if not ran.get("spatial_size"):
        ran.update(slice_method=None, num_spatial_parts=1)
    elif isinstance(volume, (list, tuple)):
        ran["slice_method"] = "x".join(map(str, volume))
    elif grid is not None:
        ran["slice_method"] = None
    return ran


def finite_or_none(value: float) -> float | None:
    """``value``, or None for NaN/inf (JSON has no NaN)."""
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class RankMetrics:
    """One rank's time split and memory over the run (peak: the CUDA allocator's, or counted on CPU); ``seconds`` are
    ``compute_seconds`` + ``comm_seconds`` + ``input_wait_seconds``; ``state_bytes``: what the rank keeps between steps
    (weights and ZeRO's shards of them, their gradients, buffers, optimizer state; each storage once:
    docs/sharding.md)."""

    rank: int
    steps: int
    seconds: float
    compute_seconds: float
    comm_seconds: float
    state_bytes: int
    activation_peak_bytes: int
    peak_bytes: int
    memory_source: str          # "cuda-allocator" or "counted"
    input_wait_seconds: float = 0.0     # of ``seconds``: waiting for the input (reads inline, or the read ahead)
    host: str = field(default_factory=socket.gethostname)     # made on the rank itself: its host


@dataclass(frozen=True)
class Validation:
    """An evaluation of the weights after ``step`` optimizer steps, and how long it took."""

    step: int
    metrics: Metrics | SegmentationMetrics
    seconds: float
    loss_of: str = "cross-entropy"      # what val_loss is: the run's training loss (its class weights included)

    def as_dict(self) -> dict[str, object]:
        """``val_step``, the ``val_``-prefixed metrics, ``val_loss_of``, ``val_seconds``: the names logs and
        summaries use."""
        return {"val_step": self.step, **self.metrics.as_dict("val_"), "val_loss_of": self.loss_of,
                "val_seconds": self.seconds}

    def line(self) -> str:
        """``eval at step 20 (98 images): val_loss 0.4123 val_accuracy 0.8163 ...`` (the figures that exist)."""
        m = self.metrics
        figures = m.headline() if isinstance(m, SegmentationMetrics) else (
            ("val_loss", m.loss), ("val_accuracy", m.accuracy), ("val_balanced_accuracy", m.balanced_accuracy),
            ("val_roc_auc", m.roc_auc))
        levels = () if isinstance(m, SegmentationMetrics) else tuple(
            (f"{level.level}_{name}", value) for level in m.levels
            for name, value in (("balanced_accuracy", level.balanced_accuracy), ("roc_auc", level.roc_auc)))
        shown = [f"{name} {value:.4f}" for name, value in (*figures, *levels) if isinstance(value, float)]
        return f"eval at step {self.step} ({m.count} images): " + " ".join(shown)


@dataclass(frozen=True)
class TrainSummary:
    """A run's result on rank 0: what it trained (``record``; None when the caller gave none), its steps and
    losses, every rank's figures, the latest evaluation. ``to_json`` is the command's last line."""

    record: RunRecord | None
    world_size: int
    start_step: int
    steps: int
    steps_run: int
    untimed_steps: int                       # the first steps left out of images_per_s (0 or 1)
    images_per_s: float | None
    loss: float | None
    losses: list[float | None]
    skipped_steps: list[int]
    run_id: str
    wall_seconds: float
    ranks: Sequence[RankMetrics]
    checkpoint: str | None
    validation: Validation | None = None
    config: Mapping[str, object] = field(default_factory=dict)
    best: BestMark | None = None             # the best evaluation of a run with --keep-best
    best_checkpoint: str | None = None       # its checkpoint, when this run wrote it
    preempted: str | None = None             # the stop signal that ended the run early (run/preemption.py)
    early_stopped: int | None = None         # the step --early-stop ended the run at (None: it ran its steps)
    deterministic: bool = False              # torch's deterministic algorithms were on (--deterministic)

    @property
    def peak_memory_bytes(self) -> list[int]:
        return [r.peak_bytes for r in self.ranks]

    def as_dict(self) -> dict[str, object]:
        """The JSON record, its keys in their documented order."""
        return {
            **(self.record.summary_fields() if self.record is not None else {}),
            "world_size": self.world_size,
            "hosts": [r.host for r in self.ranks],
            "start_step": self.start_step,
            "steps": self.steps,
            "steps_run": self.steps_run,
            "untimed_steps": self.untimed_steps,
            "images_per_s": self.images_per_s,
            "loss": self.loss,
            "losses": self.losses,
            "skipped_steps": self.skipped_steps,
            "run_id": self.run_id,
            "wall_seconds": self.wall_seconds,
            "peak_memory_bytes": self.peak_memory_bytes,
            "activation_peak_bytes": [r.activation_peak_bytes for r in self.ranks],
            "state_bytes": [r.state_bytes for r in self.ranks],
            "memory_source": self.ranks[0].memory_source,
            "compute_seconds": [r.compute_seconds for r in self.ranks],
            "comm_seconds": [r.comm_seconds for r in self.ranks],
            "input_wait_seconds": [r.input_wait_seconds for r in self.ranks],
            "train_seconds": [r.seconds for r in self.ranks],
            "checkpoint": self.checkpoint,
            **(self.validation.as_dict() if self.validation is not None else {}),
            **({"best": self.best.to_dict(), "best_checkpoint": self.best_checkpoint} if self.best is not None else {}),
            **({"preempted": self.preempted} if self.preempted is not None else {}),
            **({"early_stopped": self.early_stopped} if self.early_stopped is not None else {}),
            "deterministic": self.deterministic,

            "config": config_as_run(self.config),
        }

    def __getitem__(self, key: str) -> object:
        """A figure by its JSON name (``summary["val_loss"]``), as code that read the summary dict does."""
        return self.as_dict()[key]

    def to_json(self) -> str:
        """The final one-line JSON record."""
        return json.dumps(self.as_dict(), sort_keys=False)

    def report(self) -> str:
        """Human-readable per-rank table (``-v``)."""
        model = self.record.model.label if self.record is not None else "model"
        rate = "n/a" if self.images_per_s is None else f"{self.images_per_s:.3f}"
        loss = "n/a" if self.loss is None else f"{self.loss:.4f}"
        hosts = len({r.host for r in self.ranks}) > 1          # a host column across hosts
        width = max(len(r.host) for r in self.ranks) if hosts else 0
        lines = [f"{model}: {self.steps_run} steps, {rate} images/s, final loss {loss}",
                 "rank  " + (f"{'host':<{width}}  " if hosts else "") + "peak MB  activations MB  compute s  comm s"]
        for r in self.ranks:
            host = f"{r.host:<{width}}  " if hosts else ""
            lines.append(f"{r.rank:4d}  {host}{r.peak_bytes / 2**20:7.1f}  {r.activation_peak_bytes / 2**20:14.1f}  "
                         f"{r.compute_seconds:9.2f}  {r.comm_seconds:6.2f}")
        return "\n".join(lines)
