"""FigureView: shows a matplotlib Figure as a PNG image widget and keeps the Figure for inspection."""

from __future__ import annotations

import io
from typing import Any

import ipywidgets as w
from matplotlib.figure import Figure


class FigureView:
    """An ``ipywidgets.Image`` holding the rendered ``figure`` (works headless and in tests)."""

    def __init__(self, dpi: int = 90) -> None:
        self.dpi = dpi
        self.figure: Figure | None = None
        self.widget = w.Image(format="png", layout=w.Layout(max_width="100%"))
        self.renders = 0

    def show(self, figure: Figure) -> None:
        """Render ``figure`` into the image widget."""
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=self.dpi, bbox_inches="tight")
        self.figure = figure
        self.widget.value = buffer.getvalue()
        self.renders += 1

    def _ipython_display_(self) -> None:  # pragma: no cover - display only
        from IPython.display import display

        display(self.widget)


def display_widget(widget: Any) -> None:
    """Display an ipywidget (no-op outside IPython)."""
    try:
        from IPython.display import display
    except ImportError:  # pragma: no cover
        return
    display(widget)
