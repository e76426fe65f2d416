"""What ``evaluate`` reports on rank 0: which checkpoint on which images with which layout, the metrics (tile, slide
and patient level), the one-line JSON and the levels table."""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..checkpoint.files import BestMark
from ..evaluation.metrics import LevelMetrics, Metrics
from ..evaluation.pixel_metrics import SegmentationMetrics
from .summary import config_as_run


def shown(value: float | None) -> str:
    """A figure in the levels table (``n/a`` when it does not exist)."""
    return "n/a" if value is None else f"{value:.4f}"


@dataclass(frozen=True)
class EvaluationSummary:
    """``evaluate``'s result on rank 0: which checkpoint on which images, with which layout, and the metrics."""

    checkpoint: str
    step: int
    model: str
    split: str
    app: str
    image_size: int
    batch_size: int
    dtype: str
    world_size: int
    metrics: Metrics | SegmentationMetrics
    seconds: float
    config: Mapping[str, object] = field(default_factory=dict)
    selected: str = "latest"                # --checkpoint-select
    best: BestMark | None = None            # what a best checkpoint is best at
    loss_of: str = "cross-entropy"          # what ``loss`` is: the run's training loss (its class weights included)
    aggregate: str = "mean"                 # how tiles were aggregated into the slide and patient levels
    stain: str = "none"                     # the stain normaliser the images were read through (off, none)

    @property
    def levels(self) -> tuple[LevelMetrics, ...]:
        """Slide and patient level (images of known slides; empty otherwise)."""
        return self.metrics.levels if isinstance(self.metrics, Metrics) else ()

    def as_dict(self) -> dict[str, object]:
        chosen = {"checkpoint_select": self.selected, **({"best": self.best.to_dict()} if self.best else {})}
        return {"checkpoint": self.checkpoint, **chosen, "step": self.step, "model": self.model, "split": self.split,
                "app": self.app, "image_size": self.image_size, "batch_size": self.batch_size, "dtype": self.dtype,
                "world_size": self.world_size, **self.metrics.as_dict(), "loss_of": self.loss_of,
                **({"aggregate": self.aggregate} if self.levels else {}), "stain": self.stain,
                "seconds": self.seconds,
                "config": config_as_run(self.config)}

    def table(self) -> str:
        """Tile-, slide- and patient-level figures, a line each (``evaluate`` prints it before its JSON)."""
        tile = self.metrics
        rows = [("level", "count", "accuracy", "balanced_acc", "roc_auc")]
        if isinstance(tile, Metrics):
            rows.append(("tile", str(tile.count), shown(tile.accuracy), shown(tile.balanced_accuracy),
                         shown(tile.roc_auc)))
        rows += [(m.level, str(m.count), shown(m.accuracy), shown(m.balanced_accuracy), shown(m.roc_auc))
                 for m in self.levels]
        return "\n".join("  ".join(cell.ljust(12) for cell in row).rstrip() for row in rows)

    def to_json(self) -> str:
        """The command's one JSON line."""
        return json.dumps(self.as_dict())
