"""WindowViewer: Swin's (shifted) windows on token tiles, window size and shift typed in, one window (or every
straddling one) drawn with its tokens coloured by the rank they come from (a volume's grid: one token slice)."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

import ipywidgets as w
import numpy as np

from ...spatial.geometry import TileGrid
from ..window_view import WindowGathers, draw_window_gathers
from .figure_view import FigureView, display_widget

if TYPE_CHECKING:
    import torch

STRADDLING = -1      # the window control's value for "every straddling window"


class WindowViewer:
    """A token grid of ``sizes`` on ``grid``; the window size and shift (the same on every axis) and the window
    shown are controls.

    State: ``gathers`` (the WindowGathers shown, None after invalid input), ``error`` (why not), ``view.figure``.
    """

    def __init__(self, grid: TileGrid, sizes: tuple[int, ...], image: np.ndarray | torch.Tensor | None = None, *,
                 window: int = 7, shift: int = 0) -> None:
        self.grid, self.sizes, self.image = grid, tuple(sizes), image
        self.gathers: WindowGathers | None = None
        self.error: str | None = None
        self._rebuilding = False           # new window options: one drawing at the end, not one per option change
        self.size = w.BoundedIntText(value=window, min=1, max=max(self.sizes), description="window")
        self.shift = w.BoundedIntText(value=shift, min=0, max=max(self.sizes), description="shift")
        self.window = w.Dropdown(options=[("straddling", STRADDLING)], value=STRADDLING, description="show")
        self.depth = w.IntSlider(value=0, min=0, max=self.sizes[0] - 1, description="token slice",
                                 layout=w.Layout(display="" if grid.volumetric else "none"))
        self.status, self.view = w.HTML(), FigureView()
        for control in (self.size, self.shift):
            control.observe(lambda change: self.rebuild(), names="value")
        for control in (self.window, self.depth):
            control.observe(lambda change: self.redraw(), names="value")
        self.widget = w.VBox([w.HBox([self.size, self.shift]), w.HBox([self.window, self.depth]), self.status,
                              self.view.widget])
        self.rebuild()

    def rebuild(self) -> None:
        """New windows for the typed size and shift; invalid ones show their ValueError instead of a figure."""
        axes = len(self.sizes)
        try:
            self.gathers = WindowGathers.of(self.grid, self.sizes, (self.size.value,) * axes,
                                            (self.shift.value,) * axes)
        except ValueError as exc:
            self.gathers, self.error = None, str(exc)
            self.status.value = f"<b style='color:#b00'>&#10007; {html.escape(str(exc))}</b>"
            self.view.clear()
            return
        self.error = None
        options = [("straddling", STRADDLING)] + [(f"window {i}", i) for i in range(self.gathers.windows.num_windows)]
        self._rebuilding = True
        try:
            self.window.options = options      # a window past the new count: back to the straddling ones
        finally:
            self._rebuilding = False
        self.redraw()

    def redraw(self) -> None:
        if self.gathers is None or self._rebuilding:
            return
        chosen = None if self.window.value == STRADDLING else self.window.value
        depth = self.depth.value if self.grid.volumetric else None
        self.view.show(draw_window_gathers(self.gathers, self.image, window=chosen, depth_index=depth))
        straddling = len(self.gathers.layout.straddling())
        self.status.value = (f"{self.gathers.windows.num_windows} windows, {straddling} straddle tiles "
                             f"(gathered to the rank holding most of their tokens)")

    def _ipython_display_(self) -> None:  # pragma: no cover - display only
        display_widget(self.widget)
