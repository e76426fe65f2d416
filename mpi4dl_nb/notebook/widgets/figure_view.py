"""FigureView: a matplotlib Figure shown as a PNG image widget at its own size, and kept for inspection."""

from __future__ import annotations

import io
import struct

import ipywidgets as w
from matplotlib.figure import Figure

# A laptop screen (1366x768) less JupyterLab's chrome and a widget's controls: no figure is drawn larger.
MAX_WIDTH_PX = 900
MAX_HEIGHT_PX = 520


class FigureView:
    """An ``ipywidgets.Image`` holding the rendered ``figure`` (works headless and in tests).

    The PNG is rendered at ``scale`` times its display size (crisp on high-density screens) and shown at its
    display size with its aspect ratio kept: width and height are set in pixels, never stretched by the
    surrounding box, and shrunk (width first, height following) when the output area is narrower. A figure
    larger than ``max_width`` x ``max_height`` pixels is drawn at a lower resolution to fit. ``clear()``
    removes a figure that no longer matches the controls (e.g. after invalid input).
    """

    def __init__(self, dpi: int = 90, *, max_width: int = MAX_WIDTH_PX, max_height: int = MAX_HEIGHT_PX,
                 scale: int = 2) -> None:
        self.dpi = dpi
        self.max_width = max_width
        self.max_height = max_height
        self.scale = scale
        self.figure: Figure | None = None
        self.size: tuple[int, int] | None = None     # display size in CSS pixels (width, height)
        self.widget = w.Image(format="png", layout=w.Layout(display="none"))
        self.renders = 0

    def show(self, figure: Figure) -> None:
        """Render ``figure`` into the image widget, sized to fit a laptop screen, aspect ratio kept."""
        png = _render(figure, self.dpi * self.scale)
        width, height = png_size(png)
        shrink = min(1.0, self.max_width * self.scale / width, self.max_height * self.scale / height)
        if shrink < 1.0:
            png = _render(figure, self.dpi * self.scale * shrink)
            width, height = png_size(png)
        display_w, display_h = round(width / self.scale), round(height / self.scale)
        self.figure = figure
        self.size = (display_w, display_h)
        self.widget.value = png
        layout = self.widget.layout
        layout.width, layout.height, layout.max_width = f"{display_w}px", "auto", "100%"
        layout.object_fit, layout.align_self, layout.flex = "contain", "flex-start", "0 0 auto"
        layout.display = None
        self.renders += 1

    def clear(self) -> None:
        """Remove the figure (stale after invalid input): nothing is drawn until the next ``show``."""
        self.figure = None
        self.size = None
        self.widget.value = b""
        self.widget.layout.display = "none"

    @property
    def shown(self) -> bool:
        return self.figure is not None

    def _ipython_display_(self) -> None:  # pragma: no cover - display only
        from IPython.display import display

        display(self.widget)


def _render(figure: Figure, dpi: float) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    return buffer.getvalue()


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG, read from its header."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG image")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def display_widget(widget: w.DOMWidget) -> None:
    """Display an ipywidget (no-op outside IPython)."""
    try:
        from IPython.display import display
    except ImportError:  # pragma: no cover
        return
    display(widget)
