"""The groups ``train``'s and ``evaluate``'s help lists their flags in (``schema.flag(group=...)``), in one place."""
from __future__ import annotations

MODEL = "model"
WORKLOAD = "model and data (MPI4DL flags)"
RUN = "run"
TASK = "task (segmentation)"
SLIDES = "cohorts and whole slides"
STAIN = "stain normalisation"
TRAINING = "optimizer, schedule, classes and augmentation"
EVALUATION = "evaluation"
CHECKPOINTS = "checkpoints"
