"""LearningCurves: several runs' metrics logs overlaid (loss and accuracy vs step, train vs validation)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import ipywidgets as w

from ..curves import plot_learning_curves
from .figure_view import FigureView, display_widget


class LearningCurves:
    """Pick runs (their ``--log-dir``s) and train/validation curves; ``refresh()`` rereads the logs.

    State: ``runs`` (every log given), ``run_picker.value`` (the ones drawn), ``view.figure``.
    Rereading picks up lines a running job has written since (its log is flushed per line).
    """

    def __init__(self, runs: Sequence[str | Path], labels: Sequence[str] | None = None) -> None:
        self.runs = [Path(r) for r in runs]
        names = list(labels) if labels is not None else [r.name or str(r) for r in self.runs]
        self.names = dict(zip(names, self.runs))
        self.run_picker = w.SelectMultiple(options=names, value=tuple(names), description="runs",
                                           rows=min(6, max(2, len(names))))
        self.train_box = w.Checkbox(value=True, description="train", indent=False)
        self.val_box = w.Checkbox(value=True, description="validation", indent=False)
        self.refresh_button = w.Button(description="reread logs", icon="refresh")
        self.view = FigureView()
        for control in (self.run_picker, self.train_box, self.val_box):
            control.observe(lambda change: self.refresh(), names="value")
        self.refresh_button.on_click(lambda button: self.refresh())
        controls = w.VBox([self.train_box, self.val_box, self.refresh_button])
        self.widget = w.VBox([w.HBox([self.run_picker, controls]), self.view.widget])
        self.refresh()

    def refresh(self) -> None:
        """Redraw the chosen runs from their logs as they are now."""
        chosen = list(self.run_picker.value)
        self.view.show(plot_learning_curves(*(self.names[n] for n in chosen), labels=chosen,
                                            show_train=self.train_box.value, show_validation=self.val_box.value))

    def _ipython_display_(self) -> None:  # pragma: no cover - display only
        display_widget(self.widget)
