"""TimelineView (Gantt per rank + memory bars after a run) and TrainingProgress (during training)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import ipywidgets as w

from ...comm.trace import Event
from .. import viz
from .figure_view import FigureView, display_widget


class TimelineView:
    """Gantt chart of trace events with rank and op filters, plus per-rank memory bars.

    ``events``: trace Events (or dicts) of all ranks; ``measured``/``estimate``: per-rank
    peak bytes. State: ``visible`` (events drawn), ``view.figure``, ``memory_view.figure``.
    """

    def __init__(self, events: Sequence[viz.TraceRecord], measured: Sequence[float] | None = None,
                 estimate: Sequence[float] | None = None) -> None:
        self.events = [viz.as_event(e) for e in events]
        ranks = sorted({e.rank for e in self.events})
        ops = sorted({viz.op_label(e.op) for e in self.events})
        self.rank_filter = w.SelectMultiple(options=ranks, value=tuple(ranks), description="ranks",
                                            rows=min(6, max(2, len(ranks))))
        self.op_filter = w.SelectMultiple(options=ops, value=tuple(ops), description="ops",
                                          rows=min(6, max(2, len(ops))))
        self.summary = w.HTML()
        self.view = FigureView()
        self.memory_view = FigureView()
        self.visible: list[Event] = []
        for control in (self.rank_filter, self.op_filter):
            control.observe(lambda change: self.update(), names="value")
        parts: list[w.DOMWidget] = [w.HBox([self.rank_filter, self.op_filter]), self.summary, self.view.widget]
        if measured is not None or estimate is not None:
            self.memory_view.show(viz.draw_memory_bars(measured, estimate))
            parts.append(self.memory_view.widget)
        self.widget = w.VBox(parts)
        self.update()

    def update(self) -> None:
        ranks, ops = set(self.rank_filter.value), set(self.op_filter.value)
        self.visible = [e for e in self.events if e.rank in ranks and viz.op_label(e.op) in ops]
        self.view.show(viz.draw_timeline(self.visible))
        totals: dict[str, float] = {}
        for e in self.visible:
            key = viz.op_label(e.op)
            totals[key] = totals.get(key, 0.0) + e.duration
        self.summary.value = " &nbsp; ".join(f"{op}: {secs * 1e3:.1f} ms" for op, secs in
                                             sorted(totals.items(), key=lambda kv: -kv[1]))

    def _ipython_display_(self) -> None:  # pragma: no cover - display only
        display_widget(self.widget)


class TrainingProgress:
    """A progress bar with loss and images/s, updated after every step."""

    def __init__(self, total_steps: int, description: str = "training") -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps={total_steps}: need at least 1 step")
        self.bar = w.IntProgress(value=0, min=0, max=total_steps, description=description)
        self.label = w.HTML()
        self.widget = w.HBox([self.bar, self.label])
        self.losses: list[float] = []
        self.images_per_second: list[float] = []

    def update(self, step: int, loss: float, images_per_second: float | None = None) -> None:
        self.bar.value = min(step, self.bar.max)
        self.losses.append(float(loss))
        rate = ""
        if images_per_second is not None:
            self.images_per_second.append(float(images_per_second))
            rate = f", {images_per_second:.2f} images/s"
        self.label.value = f"step {step}/{self.bar.max}: loss {loss:.4f}{rate}"

    def run(self, step: Callable[[int], float], images_per_step: int) -> list[float]:
        """Call ``step(i) -> loss`` for every step, updating the bar; returns the losses."""
        for i in range(1, self.bar.max + 1):
            start = time.perf_counter()
            loss = step(i)
            self.update(i, loss, images_per_step / max(time.perf_counter() - start, 1e-9))
        return self.losses

    def _ipython_display_(self) -> None:  # pragma: no cover - display only
        display_widget(self.widget)
