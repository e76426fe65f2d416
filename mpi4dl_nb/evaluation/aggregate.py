"""Slide- and patient-level results: tile probabilities aggregated per slide (mean, max or mean of the top k per
class) and per patient (its slides' aggregated the same way), with accuracy, balanced accuracy, AUC and confusion
at each level. Pure numpy, on rank 0's merged records, so exact whatever the layout."""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np

from ..errors import ConfigError
from .metrics import LevelMetrics, Records, macro_auc, roc_auc
from .pixel_metrics import confusion_counts
from .split import group_label

KNOB = "--aggregate"
DEFAULT_TOP_K = 5


class AggregateKind(str, Enum):
    MEAN = "mean"
    MAX = "max"
    TOP_K = "top-k"


@dataclass(frozen=True)
class Aggregation:
    """How a group's tile probabilities become one: per class, their mean, their max, or the mean of the ``k``
    highest (all when fewer)."""

    kind: AggregateKind = AggregateKind.MEAN
    k: int = DEFAULT_TOP_K

    @classmethod
    def parse(cls, text: str) -> Aggregation:
        """``mean``, ``max``, ``top-k`` (k = 5) or ``top-N``; ConfigError naming the choices."""
        value = text.strip().lower()
        if value in (AggregateKind.MEAN.value, AggregateKind.MAX.value, AggregateKind.TOP_K.value):
            return cls(AggregateKind(value))
        found = re.fullmatch(r"top-(\d+)", value)
        if found and int(found.group(1)) >= 1:
            return cls(AggregateKind.TOP_K, int(found.group(1)))
        raise ConfigError(KNOB, f"{text!r}: choose mean, max, top-k (the {DEFAULT_TOP_K} highest) or top-N")

    def describe(self) -> str:
        return f"top-{self.k}" if self.kind is AggregateKind.TOP_K else self.kind.value

    def apply(self, probabilities: np.ndarray) -> np.ndarray:
        """One probability per class from the rows of ``probabilities`` (tiles x classes)."""
        if self.kind is AggregateKind.MEAN:
            return probabilities.mean(axis=0)
        if self.kind is AggregateKind.MAX:
            return probabilities.max(axis=0)
        top = np.sort(probabilities, axis=0)[-self.k:]
        return top.mean(axis=0)


MEAN = Aggregation()          # the default: a slide's probabilities are its tiles' mean


@dataclass(frozen=True)
class GroupPrediction:
    """A slide's (or patient's) aggregated prediction: its name, patient, label, tiles and class probabilities."""

    name: str
    patient: str
    label: int
    tiles: int
    probabilities: tuple[float, ...]

    @property
    def predicted(self) -> int:
        return int(np.argmax(self.probabilities))


def softmax(logits: np.ndarray) -> np.ndarray:
    """Class probabilities of rows of logits (float64)."""
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def by_slide(records: Records, slides: Sequence[str], patients: Sequence[str],
             rule: Aggregation) -> list[GroupPrediction]:
    """Each slide's prediction from its tiles' records (``slides[i]``/``patients[i]``: record ``i``'s), slides
    sorted by name; a slide's label is its tiles' most frequent one."""
    probabilities = softmax(records.logits)
    rows: dict[str, list[int]] = {}
    for row, slide in enumerate(slides):
        rows.setdefault(slide, []).append(row)
    return [GroupPrediction(slide, patients[picked[0]], group_label([int(records.label[r]) for r in picked]),
                            len(picked), tuple(float(p) for p in rule.apply(probabilities[picked])))
            for slide, picked in sorted(rows.items())]


def by_patient(slides: Sequence[GroupPrediction], rule: Aggregation) -> list[GroupPrediction]:
    """Each patient's prediction: its slides' probabilities aggregated by ``rule``, patients sorted by name."""
    grouped: dict[str, list[GroupPrediction]] = {}
    for slide in slides:
        grouped.setdefault(slide.patient, []).append(slide)
    return [GroupPrediction(patient, patient, group_label([s.label for s in members]), sum(s.tiles for s in members),
                            tuple(float(p) for p in rule.apply(np.array([s.probabilities for s in members]))))
            for patient, members in sorted(grouped.items())]


def level_metrics(level: str, predictions: Sequence[GroupPrediction], num_classes: int) -> LevelMetrics:
    """The figures of ``predictions`` (one level's groups)."""
    labels = np.array([p.label for p in predictions], dtype=np.int64)
    predicted = np.array([p.predicted for p in predictions], dtype=np.int64)
    matrix = confusion_counts(labels, predicted, num_classes)
    support = matrix.sum(axis=1)
    recall = [float(matrix[c, c] / support[c]) for c in range(num_classes) if support[c]]
    count = len(predictions)
    auc = None
    if num_classes == 2 and count:
        auc = roc_auc(np.array([p.probabilities[1] for p in predictions]), labels == 1)
    elif num_classes > 2 and count:
        probabilities = np.array([p.probabilities for p in predictions], dtype=np.float64)
        auc = macro_auc([roc_auc(probabilities[:, c], labels == c) for c in range(num_classes)])
    return LevelMetrics(level, count, float(np.trace(matrix) / count) if count else None,
                        float(sum(recall) / len(recall)) if recall else None, auc, matrix.tolist())
