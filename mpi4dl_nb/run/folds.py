"""Cross-validation: ``train --folds K`` without ``--fold`` as K jobs, fold by fold (each with its own checkpoint
and log directory ``<dir>/fold-I``), and the mean and spread of each figure over the folds."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from .job import TrainPlan
from .summary import TrainSummary

FIGURES = ("loss", "val_loss", "val_accuracy", "val_balanced_accuracy", "val_roc_auc", "val_mean_dice",
           "val_mean_volume_dice")


def fold_jobs(job: TrainPlan) -> list[TrainPlan]:
    """The K jobs of ``job`` (``--folds K`` without ``--fold``): fold I held out, writing into ``<dir>/fold-I``."""
    folds = job.held_out.folds
    assert folds is not None, "a job with --folds"
    return [replace(job, held_out=replace(job.held_out, fold=i, log_dir=fold_dir(job.held_out.log_dir, i)),
                    checkpoints=replace(job.checkpoints, directory=fold_dir(job.checkpoints.directory, i)))
            for i in range(folds)]


def fold_dir(directory: str | None, fold: int) -> str | None:
    """``<directory>/fold-<fold>`` (None without a directory)."""
    return None if directory is None else str(Path(directory) / f"fold-{fold}")


def fold_report(summaries: Sequence[TrainSummary]) -> dict[str, object]:
    """Each figure's mean, spread (sample standard deviation) and values over the folds, and their checkpoints."""
    figures: dict[str, dict[str, object]] = {}
    for name in FIGURES:
        values = [summary_figure(s, name) for s in summaries]
        known = [v for v in values if v is not None]
        if not known:
            continue
        mean = sum(known) / len(known)
        spread = math.sqrt(sum((v - mean) ** 2 for v in known) / (len(known) - 1)) if len(known) > 1 else 0.0
        figures[name] = {"mean": mean, "std": spread, "values": values}
    return {"folds": len(summaries), "metrics": figures, "checkpoints": [s.checkpoint for s in summaries]}


def summary_figure(summary: TrainSummary, name: str) -> float | None:
    """The summary's figure ``name`` as a finite number (None: missing or not finite)."""
    value = summary.as_dict().get(name)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def report_lines(report: dict[str, object]) -> list[str]:
    """``val_accuracy 0.8125 +- 0.0442 over 3 folds`` per figure."""
    metrics = report["metrics"]
    assert isinstance(metrics, dict)
    return [f"{name} {entry['mean']:.4f} +- {entry['std']:.4f} over {report['folds']} folds"
            for name, entry in metrics.items()]
