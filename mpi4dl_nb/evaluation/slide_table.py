"""The per-slide CSV of an evaluation: each slide's patient, label, prediction, tiles and class probabilities."""
from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigError
from .aggregate import GroupPrediction

KNOB = "--slide-csv"


def write_slide_csv(path: str | Path, slides: Sequence[GroupPrediction], classes: Sequence[str]) -> Path:
    """Write one row per slide (columns slide, patient, label, predicted, tiles, prob_<class>...); ConfigError
    naming the path when it cannot be written."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["slide", "patient", "label", "predicted", "tiles", *(f"prob_{c}" for c in classes)])
            for s in slides:
                writer.writerow([s.name, s.patient, classes[s.label], classes[s.predicted], s.tiles,
                                 *(repr(p) for p in s.probabilities)])
    except OSError as err:
        raise ConfigError(KNOB, f"cannot write {target}: {err.strerror or err}; choose a writable path") from err
    return target
