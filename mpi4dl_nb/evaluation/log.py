"""The metrics log of a run: ``metrics.jsonl`` (one line per step and per evaluation) and, if installed, TensorBoard.

Written by one rank (rank 0), flushed after every line. A resumed run continues the file: lines
of steps after the resumed checkpoint (a stretch the crash lost and the run redoes) are dropped
first, so no step appears twice. A fresh run (step 0) finding an earlier file moves it aside
(``metrics-<its run id>.jsonl``) rather than mixing the two or deleting it.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ..config import Choice

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

LOG_NAME = "metrics.jsonl"
SCALARS = ("loss", "accuracy", "balanced_accuracy", "roc_auc", "pixel_accuracy", "mean_dice", "mean_iou")
STEP_SCALARS = {"lr": "lr", "images_per_s": "images_per_s", "seconds": "seconds_per_step"}   # a step's record key:
                                                                                             # its TensorBoard name
LogRecord = dict[str, object]    # one parsed line: JSON values by name ("kind", "step", "run_id", figures)


class RecordKind(Choice):
    """What a line of the log records: a training step or an evaluation."""

    TRAIN = "train"
    EVAL = "eval"


def read_metrics(path: str | Path) -> list[LogRecord]:
    """The records of a ``metrics.jsonl`` (or of a log directory); a torn last line is ignored."""
    target = Path(path)
    if target.is_dir():
        target = target / LOG_NAME
    records = []
    for line in target.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _clean(value: object) -> object:
    """JSON has no NaN/inf: such numbers become None."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def tensorboard_scalars(kind: RecordKind, record: Mapping[str, object]) -> dict[str, float]:
    """The TensorBoard scalars of a record, by tag: ``train/loss``, ``train/lr``, ``train/images_per_s``,
    ``train/seconds_per_step``, each parameter group's ``train/lr/<group>`` (``--layer-decay``); ``eval/loss``,
    ``eval/accuracy``, ... (the figures it has)."""
    if kind is RecordKind.TRAIN:
        names = {**{name: name for name in SCALARS}, **STEP_SCALARS}
    else:
        names = {f"val_{name}": name for name in SCALARS}
    found = {f"{kind.value}/{tag}": float(value) for key, tag in names.items()
             if isinstance(value := record.get(key), (int, float))}
    groups = {f"{kind.value}/{key}": float(value) for key, value in record.items()    # lr/block.3: a group's rate
              if kind is RecordKind.TRAIN and key.startswith("lr/") and isinstance(value, (int, float))}
    return {**found, **groups}


class MetricsLog:

    """Appends step and evaluation records to ``<directory>/metrics.jsonl`` (and TensorBoard events)."""

    def __init__(self, directory: str | Path, run_id: str, start_step: int = 0, tensorboard: bool = True) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / LOG_NAME
        self.run_id = run_id
        self.moved_aside: Path | None = None
        self._prepare(start_step)
        self.stream: TextIO = self.path.open("a")
        self.writer = self._tensorboard(start_step) if tensorboard else None

    def _prepare(self, start_step: int) -> None:
        if not self.path.exists():
            return
        old = read_metrics(self.path)
        if start_step == 0:
            if old:
                self.moved_aside = self.directory / f"metrics-{old[0].get('run_id') or 'earlier'}.jsonl"
                os.replace(self.path, self.moved_aside)
            return
        kept = [r for r in old if not (isinstance(step := r.get("step"), (int, float)) and step > start_step)]
        if len(kept) != len(old) or self.path.read_text().count("\n") != len(old):
            partial = self.path.with_suffix(".jsonl.tmp")
            partial.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(partial, self.path)

    def _tensorboard(self, start_step: int) -> SummaryWriter | None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:     # the optional extra: pip install mpi4dl-nb[tensorboard]
            return None
        return SummaryWriter(str(self.directory), purge_step=start_step + 1 if start_step else None)

    def write(self, kind: RecordKind | str, step: int, values: Mapping[str, object]) -> None:
        """One record: ``kind`` 'train' or 'eval', the global step, the values (JSON-ready)."""
        kind = RecordKind(kind)
        record = {"kind": kind.value, "step": step, "run_id": self.run_id,
                  **{k: _clean(v) for k, v in values.items()}}
        self.stream.write(json.dumps(record) + "\n")
        self.stream.flush()
        if self.writer is not None:
            for tag, value in tensorboard_scalars(kind, record).items():
                self.writer.add_scalar(tag, value, step)
            self.writer.flush()

    def close(self) -> None:
        self.stream.close()
        if self.writer is not None:
            self.writer.close()
