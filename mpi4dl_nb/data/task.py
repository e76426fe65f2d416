"""Task: what a run learns — one class per image (classification) or one class per pixel (segmentation)."""
from __future__ import annotations

from ..config import Choice, parse_choice


class Task(Choice):
    """``--task``: ``classification`` (a label per image) or ``segmentation`` (a class index per pixel)."""

    CLASSIFICATION = "classification"
    SEGMENTATION = "segmentation"

    @classmethod
    def parse(cls, text: object) -> Task:
        """``--task`` (any case); ConfigError naming the tasks otherwise."""
        return parse_choice(cls, str(text).strip().lower(), "--task", f"one of {', '.join(cls.values())}")

    @property
    def dense(self) -> bool:
        """Whether the labels are per-pixel masks (the model outputs a class map as large as the image)."""
        return self is Task.SEGMENTATION
