"""What an inference run reports: each rank's figures and the summary rank 0 prints as one JSON line."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from ..comm.trace import TraceValue
from .outputs.finish import OutputReport
from .outputs.placement import CellPlacement
from .windows import AxisField


@dataclass
class RankStats:
    """What one rank measured."""

    seconds: float = 0.0
    compute_seconds: float = 0.0
    read_seconds: float = 0.0
    read_wait_seconds: float = 0.0
    peak_bytes: int = 0
    state_bytes: int = 0
    windows: int = 0


TimelineEvent = dict[str, TraceValue | dict[str, TraceValue]]   # an Event as ``Event.as_dict`` gives it


@dataclass(frozen=True)
class InferSummary:
    """The run's result on rank 0: the command's JSON line (``dl.infer_slide`` returns ``as_dict()``)."""

    slide: str
    level: int
    slide_size: tuple[int, int]                  # (width, height) of the pixels read
    model: str
    checkpoint: str
    task: str
    classes: tuple[str, ...]
    mpp: float | None                            # µm per pixel read (None: unknown)
    scale: float                                 # resampling of the level read (1.0: none)
    placement: CellPlacement
    output_shape: tuple[int, int, int]           # classes, output rows, output columns
    output_stride: int
    fields: tuple[AxisField, AxisField]          # rows, columns
    world_size: int
    grid: tuple[int, int]
    window: int
    window_grid: tuple[int, int]
    dtype: str
    windows: int
    skipped_background: int
    computed_windows: int
    first_row: int
    rows_done: int
    complete: bool
    megapixels: float
    ranks: Sequence[RankStats]
    memory_source: str
    outputs: list[str]
    report: OutputReport | None = None           # per-class figures of the finished map (rank 0, complete runs)
    events: list[TimelineEvent] | None = None    # every rank's timeline (``keep_trace``)

    @property
    def seconds(self) -> float:
        return max(r.seconds for r in self.ranks)

    def as_dict(self) -> dict[str, object]:
        rows, cols = self.fields
        seconds = self.seconds
        return {
            "slide": self.slide, "level": self.level, "slide_size": list(self.slide_size),
            "mpp": self.mpp, "scale": self.scale, "model": self.model, "checkpoint": self.checkpoint,
            "task": self.task, "classes": list(self.classes),
            "output_shape": list(self.output_shape), "output_stride": self.output_stride,
            "field": {"rows": [rows.before, rows.after], "cols": [cols.before, cols.after],
                      "text": cols.describe()},
            "map": self.placement.describe(),
            "world_size": self.world_size, "grid": list(self.grid),
            "window": self.window, "window_grid": list(self.window_grid), "dtype": self.dtype,
            "windows": self.windows, "skipped_background": self.skipped_background,
            "computed_windows": self.computed_windows,
            "first_row": self.first_row, "rows_done": self.rows_done, "complete": self.complete,
            "seconds": seconds, "megapixels": self.megapixels,
            "megapixels_per_s": self.megapixels / seconds if seconds > 0 else None,
            "peak_memory_bytes": [r.peak_bytes for r in self.ranks],
            "memory_source": self.memory_source,
            "compute_seconds": [r.compute_seconds for r in self.ranks],
            "read_seconds": [r.read_seconds for r in self.ranks],
            "read_wait_seconds": [r.read_wait_seconds for r in self.ranks],
            "outputs": self.outputs,
            **(self.report.as_dict() if self.report is not None else {}),
            **({"events": self.events} if self.events is not None else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict())

