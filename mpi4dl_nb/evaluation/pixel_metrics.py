"""Segmentation metrics from pixel counts (pure numpy): per-class Dice and IoU, pixel accuracy, the confusion matrix.

Each rank counts the pixels of the tiles it predicted: a confusion matrix of integers (``m[true][predicted]``
over the pixels whose label is not the ignore index) and, per image, the sums the loss is made of. Rank 0
adds them up: integer counts are exact whatever the layout, and a figure is computed once from the
totals (Dice and IoU of a class from its true positives, false positives and false negatives over every
pixel of the set), never as an average of per-tile or per-rank figures. Volumes also count each volume's own
confusion matrix (its tiles' added up), for a Dice per volume (``sample_dice``) and their mean.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np


@dataclass(frozen=True)
class PixelRecords:
    """What some ranks counted: per image (``index``: dataset positions, unique) its loss sums, and the
    confusion matrix of their pixels. Loss sums as ``loss.PixelSums`` (float64 arrays)."""

    index: np.ndarray        # int64 (n,)
    nll: np.ndarray          # (n, 0 or 1)
    weight: np.ndarray       # (n, 0 or 1)
    overlap: np.ndarray      # (n, 0 or C)
    size: np.ndarray         # (n, 0 or C)
    confusion: np.ndarray    # int64 (C, C)
    per_image: np.ndarray | None = None   # int64 (n, C, C): each image's own confusion matrix (None: not counted)

    def __len__(self) -> int:
        return int(self.index.shape[0])


def confusion_counts(label: np.ndarray, predicted: np.ndarray, num_classes: int,
                     ignore_index: int | None = None) -> np.ndarray:
    """``m[t, p]``: how many samples (or pixels) of true class ``t`` were predicted ``p``, those labelled
    ``ignore_index`` left out: the one confusion matrix of classifier and segmentation evaluations."""
    label, predicted = np.asarray(label).reshape(-1), np.asarray(predicted).reshape(-1)
    if ignore_index is not None:
        keep = label != ignore_index
        label, predicted = label[keep], predicted[keep]
    flat = np.bincount(label.astype(np.int64) * num_classes + predicted, minlength=num_classes * num_classes)
    return flat.reshape(num_classes, num_classes).astype(np.int64)


def merge_pixels(parts: Sequence[PixelRecords], num_classes: int) -> PixelRecords:
    """Every part's records as one: loss sums added per image (an image's tiles on several ranks), sorted by
    image; confusion matrices added."""
    confusion = np.zeros((num_classes, num_classes), dtype=np.int64)
    for part in parts:
        confusion += part.confusion
    filled = [p for p in parts if len(p)]
    if not filled:
        empty = np.zeros((0, 0))
        return PixelRecords(np.zeros(0, np.int64), empty, empty, empty, empty, confusion)
    index = np.concatenate([p.index for p in filled])
    images, slot = np.unique(index, return_inverse=True)

    def added(name: str) -> np.ndarray:
        values = np.concatenate([getattr(p, name) for p in filled])
        out = np.zeros((len(images), values.shape[1]))
        np.add.at(out, slot, values)
        return out

    per_image = None
    if all(p.per_image is not None for p in filled):
        per_image = np.zeros((len(images), num_classes, num_classes), dtype=np.int64)
        np.add.at(per_image, slot, np.concatenate([p.per_image for p in filled if p.per_image is not None]))
    return PixelRecords(images.astype(np.int64), added("nll"), added("weight"), added("overlap"), added("size"),
                        confusion, per_image)


def sample_dice(matrix: np.ndarray) -> float | None:
    """One image's (a volume's) Dice from its confusion matrix: ``2 TP / (2 TP + FP + FN)`` of each class present in
    its labels (background included), averaged over those classes; a class absent from the labels is left out even when
    predicted (its false positives still lower the Dice of the classes they were labelled). None: no counted
    pixel."""
    hits = np.diag(matrix)
    labelled, predicted = matrix.sum(axis=1), matrix.sum(axis=0)
    present = np.flatnonzero(labelled)
    if present.size == 0:
        return None
    return float(np.mean(2 * hits[present] / (labelled[present] + predicted[present])))


def _ratio(numerator: float, denominator: float) -> float | None:
    return float(numerator / denominator) if denominator else None


@dataclass(frozen=True)
class SegmentationMetrics:
    """The figures of a segmentation evaluation, JSON-ready (None where undefined: a class absent from both the
    labels and the predictions has no Dice or IoU).

    ``dice[c] = 2 TP / (2 TP + FP + FN)``, ``iou[c] = TP / (TP + FP + FN)`` over every counted pixel of the set;
    ``mean_dice``/``mean_iou`` over the classes where they are defined; ``pixel_accuracy`` = correct / counted
    pixels; ``loss`` the training loss over the whole set (cross-entropy over all pixels, Dice per image).
    """

    count: int
    pixels: int
    loss: float | None
    pixel_accuracy: float | None
    dice: list[float | None]
    iou: list[float | None]
    mean_dice: float | None
    mean_iou: float | None
    confusion_matrix: list[list[int]]
    classes: tuple[str, ...] = ()
    volume_dice: list[float | None] | None = None   # volumes: each one's Dice (``sample_dice``; None: not counted)
    mean_volume_dice: float | None = None           # their mean over the volumes with a Dice

    def with_volume_dice(self, records: PixelRecords) -> SegmentationMetrics:
        """These metrics with each volume's Dice (``sample_dice``) and their mean, from ``records.per_image``."""
        assert records.per_image is not None, "records counted per image"
        each = [sample_dice(m) for m in records.per_image]
        known = [d for d in each if d is not None]
        return replace(self, volume_dice=each, mean_volume_dice=float(np.mean(known)) if known else None)

    @property
    def accuracy(self) -> float | None:
        """Pixel accuracy (the name progress lines and classifier figures use)."""
        return self.pixel_accuracy

    def as_dict(self, prefix: str = "") -> dict[str, object]:
        """``{'dice': [...], ...}`` (``prefix="val_"``: ``val_dice``); with class names also ``classes``,
        ``dice_by_class`` and ``iou_by_class`` (name -> figure)."""
        figures: dict[str, object] = {"task": "segmentation", **asdict(self)}
        if self.volume_dice is None:
            del figures["volume_dice"], figures["mean_volume_dice"]
        names = figures.pop("classes")
        if names:
            figures["classes"] = list(self.classes)
            figures["dice_by_class"] = dict(zip(self.classes, self.dice))
            figures["iou_by_class"] = dict(zip(self.classes, self.iou))
        return {prefix + key: value for key, value in figures.items()}

    def headline(self) -> list[tuple[str, float | None]]:
        """The figures an evaluation's one-line report shows, by their ``val_`` names."""
        shown = [("val_loss", self.loss), ("val_pixel_accuracy", self.pixel_accuracy),
                 ("val_mean_dice", self.mean_dice), ("val_mean_iou", self.mean_iou)]
        return shown if self.volume_dice is None else [*shown, ("val_mean_volume_dice", self.mean_volume_dice)]


def summarize_pixels(records: PixelRecords, loss: float | None, num_classes: int,
                     classes: Sequence[str] = ()) -> SegmentationMetrics:
    """The metrics of merged records (``loss`` computed from their sums by the run's loss)."""
    matrix = records.confusion
    hits = np.diag(matrix).astype(np.int64)
    false_positive = matrix.sum(axis=0) - hits
    false_negative = matrix.sum(axis=1) - hits
    dice = [_ratio(2 * hits[c], 2 * hits[c] + false_positive[c] + false_negative[c]) for c in range(num_classes)]
    iou = [_ratio(hits[c], hits[c] + false_positive[c] + false_negative[c]) for c in range(num_classes)]
    defined_dice = [d for d in dice if d is not None]
    defined_iou = [v for v in iou if v is not None]
    pixels = int(matrix.sum())
    return SegmentationMetrics(
        count=len(records), pixels=pixels, loss=loss, pixel_accuracy=_ratio(int(hits.sum()), pixels),
        dice=dice, iou=iou,
        mean_dice=float(np.mean(defined_dice)) if defined_dice else None,
        mean_iou=float(np.mean(defined_iou)) if defined_iou else None,
        confusion_matrix=matrix.tolist(), classes=tuple(classes))

