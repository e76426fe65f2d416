"""Classification metrics from per-sample records (pure numpy): loss, accuracy, balanced accuracy, recall, AUC (two
classes: of the second class; more: one class against the rest, per class and their macro mean).

Every figure is computed from the merged per-sample records of all ranks (sorted by sample
index), so it is a sum of counts or losses over the whole set divided once — never an
average of per-rank averages — and the same for any rank layout.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ..config import Choice
from .pixel_metrics import SegmentationMetrics, confusion_counts


@dataclass(frozen=True)
class Records:
    """Per-sample results: dataset position, true label, loss and the logits (rows of ``logits``)."""

    index: np.ndarray     # int64 (N,)
    label: np.ndarray     # int64 (N,)
    loss: np.ndarray      # float64 (N,)
    logits: np.ndarray    # float64 (N, K)

    @classmethod
    def empty(cls, num_classes: int) -> Records:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros((0, num_classes)))

    def __len__(self) -> int:
        return int(self.index.shape[0])

    @property
    def predicted(self) -> np.ndarray:
        return np.argmax(self.logits, axis=1) if len(self) else np.zeros(0, np.int64)


def merge(parts: Sequence[Records], num_classes: int) -> Records:
    """Every rank's records as one set sorted by sample index; ValueError if a sample appears twice."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return Records.empty(num_classes)
    index = np.concatenate([p.index for p in parts])
    order = np.argsort(index, kind="stable")
    if np.any(np.diff(index[order]) == 0):
        raise ValueError("a sample was evaluated twice; the evaluation batches overlap")
    return Records(index[order], np.concatenate([p.label for p in parts])[order],
                   np.concatenate([p.loss for p in parts])[order],
                   np.concatenate([p.logits for p in parts])[order])


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks of ``values``, ties given the mean of the ranks they span."""
    order = np.argsort(values, kind="mergesort")
    ordered = values[order]
    ranks = np.empty(len(values), dtype=np.float64)
    start = 0
    while start < len(values):
        stop = start
        while stop + 1 < len(values) and ordered[stop + 1] == ordered[start]:
            stop += 1
        ranks[order[start:stop + 1]] = (start + stop) / 2 + 1
        start = stop + 1
    return ranks


def roc_auc(score: np.ndarray, positive: np.ndarray) -> float | None:
    """Area under the ROC curve, exactly, by the rank statistic (Mann-Whitney U; ties count half).

    ``score``: higher means more likely positive; ``positive``: booleans. None when one class is absent.
    """
    positive = np.asarray(positive, dtype=bool)
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    rank_sum = float(average_ranks(np.asarray(score, dtype=np.float64))[positive].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def class_log_odds(logits: np.ndarray) -> np.ndarray:
    """``log(p / (1 - p))`` of each class's softmax probability ``p`` in rows of logits (two classes or more): its
    logit less the log-sum-exp of the others'. It orders samples as ``p`` does, without ``p``'s rounding to 1; with
    two classes it is the logits' difference."""
    columns = []
    for c in range(logits.shape[1]):
        others = np.delete(logits, c, axis=1)
        top = others.max(axis=1, keepdims=True)
        columns.append(logits[:, c] - (top[:, 0] + np.log(np.exp(others - top).sum(axis=1))))
    return np.stack(columns, axis=1)


def one_vs_rest_auc(logits: np.ndarray, labels: np.ndarray) -> list[float | None]:
    """Each class's AUC against the rest: its probability ranking its samples (``labels == c``) above the others'
    (``roc_auc`` of ``class_log_odds``; None for a class with no samples, or only its own; fewer than two classes:
    None)."""
    classes = logits.shape[1]
    if classes < 2:
        return [None] * classes
    scores = class_log_odds(np.asarray(logits, dtype=np.float64))
    return [roc_auc(scores[:, c], labels == c) for c in range(classes)]


def macro_auc(per_class: Sequence[float | None]) -> float | None:
    """The mean of the classes' one-vs-rest AUCs, as sklearn's ``roc_auc_score(multi_class='ovr',
    average='macro')``; None when a class has none (sklearn refuses a class absent from the labels)."""
    if not per_class or any(v is None for v in per_class):
        return None
    return float(sum(v for v in per_class if v is not None) / len(per_class))


@dataclass(frozen=True)
class LevelMetrics:
    """The figures of one level (``slide``, ``patient``): count, accuracy, balanced accuracy, AUC (2 classes: of
    the second class's aggregated probability; more: the macro mean of each class's one-vs-rest AUC of its
    aggregated probability, None when a class is absent), confusion matrix; None where undefined."""

    level: str
    count: int
    accuracy: float | None
    balanced_accuracy: float | None
    roc_auc: float | None
    confusion_matrix: list[list[int]]

    def as_dict(self) -> dict[str, object]:
        return {"count": self.count, "accuracy": self.accuracy, "balanced_accuracy": self.balanced_accuracy,
                "roc_auc": self.roc_auc, "confusion_matrix": self.confusion_matrix}


@dataclass(frozen=True)
class Metrics:
    """The figures of an evaluation, JSON-ready (None where undefined: no samples, a class absent). ``roc_auc``: two
    classes, the second class's AUC; more, the macro mean of the classes' one-vs-rest AUCs (``per_class_roc_auc``)."""

    count: int
    loss: float | None
    accuracy: float | None
    balanced_accuracy: float | None
    per_class_recall: list[float | None]
    roc_auc: float | None
    per_class_roc_auc: list[float | None]
    confusion_matrix: list[list[int]]
    classes: tuple[str, ...] = ()        # the class names, in label order (empty: not known)
    levels: tuple[LevelMetrics, ...] = ()  # slide and patient level (images of known slides; empty: none)

    def as_dict(self, prefix: str = "") -> dict[str, object]:
        """``{'loss': ..}``, or with ``prefix="val_"`` ``{'val_loss': ..}`` (the names summaries use); with class
        names, ``classes``, ``recall_by_class`` and ``roc_auc_by_class`` (name -> figure) too; each level under its
        name (``slide``, ``patient``)."""
        figures = asdict(self)
        names = figures.pop("classes")
        figures.pop("levels")
        if names:
            figures["classes"] = list(names)
            figures["recall_by_class"] = dict(zip(names, self.per_class_recall))
            figures["roc_auc_by_class"] = dict(zip(names, self.per_class_roc_auc))
        figures.update({level.level: level.as_dict() for level in self.levels})
        return {prefix + key: value for key, value in figures.items()}


class MetricName(Choice):
    """A validation figure a run may keep its best checkpoint by (``--keep-best``), and which way is better."""

    VAL_LOSS = "val_loss"
    VAL_ACCURACY = "val_accuracy"
    VAL_BALANCED_ACCURACY = "val_balanced_accuracy"
    VAL_ROC_AUC = "val_roc_auc"
    VAL_MEAN_DICE = "val_mean_dice"      # segmentation (pixel_metrics.SegmentationMetrics)
    VAL_MEAN_IOU = "val_mean_iou"        # segmentation

    @property
    def lower_is_better(self) -> bool:
        return self is MetricName.VAL_LOSS

    def of(self, metrics: Metrics | SegmentationMetrics) -> float | None:
        """This figure of ``metrics`` (None: undefined, not finite, or not a figure of that task)."""
        value = getattr(metrics, self.value.removeprefix("val_"), None)
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None

    def better(self, value: float, than: float | None) -> bool:
        """Whether ``value`` is strictly better than ``than`` (None: nothing yet)."""
        return than is None or (value < than if self.lower_is_better else value > than)


def summarize(records: Records, num_classes: int, classes: Sequence[str] = ()) -> Metrics:
    """The metrics of a merged set of records (``classes``: their names, in label order)."""
    count = len(records)
    matrix = confusion_counts(records.label, records.predicted, num_classes)
    support = matrix.sum(axis=1)
    recall = [float(matrix[c, c] / support[c]) if support[c] else None for c in range(num_classes)]
    present = [r for r in recall if r is not None]
    per_class = one_vs_rest_auc(records.logits, records.label)
    auc = per_class[1] if num_classes == 2 else macro_auc(per_class) if num_classes > 2 else None
    return Metrics(
        count=count,
        loss=float(records.loss.sum() / count) if count else None,
        accuracy=float(np.trace(matrix) / count) if count else None,
        balanced_accuracy=float(sum(present) / len(present)) if present else None,
        per_class_recall=recall,
        roc_auc=auc,
        per_class_roc_auc=per_class,
        confusion_matrix=matrix.tolist(),
        classes=tuple(classes),
    )
