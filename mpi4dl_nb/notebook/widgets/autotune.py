"""AutoTune: the planner's top configurations run on the cluster, predicted next to measured, best picked."""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from typing import Unpack

import ipywidgets as w
from matplotlib.figure import Figure

from ...config import ParallelConfig
from ...measure.trials import TrialModel
from ...planner.memory import MB
from ...planner.suggest import SuggestOptions
from ...planner.tune import Tuner, TuneResult, TuneRow
from ..cluster import Cluster
from .figure_view import FigureView, display_widget

RowValue = Callable[[TuneRow], float]   # what a bar of the tune figure shows of a row


def draw_tune_result(result: TuneResult) -> Figure:
    """Step time (left) and largest per-rank peak (right), predicted next to measured, per row."""
    fig = Figure(figsize=(10, 0.45 * len(result.rows) + 1.6))
    labels = [f"{i}. {row.label}" if row.cfg is not None else row.label for i, row in enumerate(result.rows)]
    positions = list(range(len(result.rows)))[::-1]
    panels: tuple[tuple[str, RowValue, RowValue, float], ...] = (
        ("seconds per step", lambda r: r.predicted_seconds, lambda r: r.measured.seconds if r.measured else 0.0, 1.0),
        ("largest rank peak (MB)", lambda r: r.predicted_peak, lambda r: r.measured.peak if r.measured else 0, MB))
    for k, (title, predicted, measured, scale) in enumerate(panels):
        ax = fig.add_subplot(1, 2, k + 1)
        for y, row in zip(positions, result.rows):
            ax.barh(y + 0.2, predicted(row) / scale, 0.4, color="#DD8452", gid=f"tune:predicted:{y}",
                    label="predicted" if y == positions[0] else None)
            if row.measured is not None:
                ax.barh(y - 0.2, measured(row) / scale, 0.4, color="#4C72B0", gid=f"tune:measured:{y}",
                        label="measured" if y == positions[0] else None)
        if k == 1:
            ax.axvline(result.limit / MB, color="#C44E52", linestyle="--", label="limit", gid="tune:limit")
            ax.set_yticks([])
        else:
            ax.set_yticks(positions)
            ax.set_yticklabels(labels, fontsize=8)
        best = result.best
        if best is not None:
            y = positions[result.rows.index(best)]
            ax.axhspan(y - 0.5, y + 0.5, color="#55A868", alpha=0.15, gid="tune:best")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


class AutoTune:
    """Live auto-tune on an ipyparallel ``cluster``: calibrate the network, ``suggest`` for the
    cluster's ranks under the memory limit, run the top ``top`` configurations and the
    one-process reference for ``steps`` timed steps each, show predicted vs measured.
    ``memory_limit_mb`` is shown and used rounded to 0.1 MB, as a user would type it.

    ``run()`` (or the Run button) tunes; then ``result`` (planner ``TuneResult``), ``best``
    (the fastest measured configuration that fits), ``table.value``, ``view.figure`` and, in a
    closed section, ``phases.value``: each rank's predicted and traced seconds per action kind.
    """

    def __init__(self, cluster: Cluster, spec: TrialModel, image_size: int, batch_size: int, *,
                 memory_limit_mb: float, top: int = 3, steps: int = 2, timeout: float = 1800.0,
                 **suggest_options: Unpack[SuggestOptions]) -> None:
        self.cluster = cluster
        self.spec = spec
        self.image_size = image_size
        self.batch_size = batch_size
        self.timeout = timeout
        self.suggest_options = suggest_options
        self.limit = w.BoundedFloatText(value=round(memory_limit_mb, 1), min=0.1, max=1e9, step=1.0,
                                        description="memory limit (MB/rank)",
                                        style={"description_width": "initial"})
        self.top = w.BoundedIntText(value=top, min=1, max=32, description="candidates")
        self.steps = w.BoundedIntText(value=steps, min=1, max=100, description="timed steps")
        self.button = w.Button(description="Run auto-tune", button_style="primary")
        self.status = w.HTML()
        self.table = w.HTML()
        self.phases = w.HTML()     # each rank's predicted and traced phases (``TuneResult.explain``)
        self.details = w.Accordion(children=[self.phases], titles=("per rank: predicted / traced seconds by action",))
        self.view = FigureView()
        self.result: TuneResult | None = None
        self.button.on_click(lambda _: self.run())
        self.widget = w.VBox([w.HBox([self.limit, self.top, self.steps, self.button]), self.status,
                              self.table, self.view.widget, self.details])

    @property
    def best(self) -> ParallelConfig | None:
        """The picked ParallelConfig (None before a run, or if nothing fits)."""
        row = self.result.best if self.result is not None else None
        return row.cfg if row is not None else None

    def _show(self, result: TuneResult) -> None:
        self.result = result
        self.table.value = f"<pre>{html.escape(result.table())}</pre>"
        self.phases.value = f"<pre>{html.escape(result.explain())}</pre>"
        self.view.show(draw_tune_result(result))
        done = sum(1 for row in result.rows if row.measured is not None)
        self.status.value = f"measured {done} of {len(result.rows)}"

    def _tuner(self) -> Tuner:
        return Tuner.on_cluster(self.cluster, self.spec, self.image_size, self.batch_size,
                                self.limit.value * MB, timeout=self.timeout, top=self.top.value,
                                steps=self.steps.value, suggest_options=self.suggest_options.copy())

    def sweep(self, base: ParallelConfig | None = None, knobs: Sequence[str] | None = None) -> TuneResult:
        """Run a one-knob sweep around ``base`` (default: the picked configuration): one
        process, ``base`` and every valid change of one knob on the same ranks, predicted
        next to measured (the network calibrated by the last run, else now)."""
        base = base if base is not None else self.best
        if base is None:
            raise ValueError("sweep needs a base configuration: pass one, or run() the auto-tune first")
        self.status.value = "planning the sweep..."
        tuner = self._tuner()
        network = self.result.network if self.result is not None else None
        result = tuner.sweep(base, network) if knobs is None else tuner.sweep(base, network, tuple(knobs))
        self._show(result)
        return tuner.measure_all(result, self._show)

    def run(self) -> TuneResult:
        """Tune now (blocks until every candidate ran); returns the result."""
        self.status.value = "calibrating the network and planning..."
        tuner = self._tuner()
        try:
            result = tuner(progress=self._show)
        except ValueError as err:    # nothing fits the limit: say what to change
            self.status.value = f"<b>{html.escape(str(err))}</b>"
            raise
        best = result.best
        self.status.value = (f"picked <b>{html.escape(best.label)}</b>" if best is not None
                             else "<b>no candidate fits the limit as measured</b>")
        return result

    def _ipython_display_(self) -> None:  # pragma: no cover - display only
        display_widget(self.widget)
