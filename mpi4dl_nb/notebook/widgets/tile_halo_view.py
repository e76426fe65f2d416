"""TileHaloView: what the 2-D and the volume halo viewers share (tile menu, refusal shown, redraw on change)."""

from __future__ import annotations

import html
from collections.abc import Mapping

import ipywidgets as w
from matplotlib.figure import Figure

from ...errors import ConfigError
from ...spatial.geometry import LayerHalo, TileGrid
from .figure_view import FigureView


class TileHaloView:
    """A layer's halo on a tile grid, redrawn when a control changes; a grid that cannot carry the layer shows
    its ConfigError instead of a stale figure. Subclasses build the controls and say how to cut the grid, what
    the status line says and what to draw."""

    tile_choice: w.Dropdown
    status: w.HTML
    info: w.HTML
    view: FigureView
    grid: TileGrid | None
    halo: LayerHalo | None
    error: str | None
    _updating: bool = False

    def start_view(self, figure_px: int) -> None:
        """The tile menu, status line, figure and text, empty until the first ``update``."""
        self.tile_choice = w.Dropdown(description="tile")
        self.status = w.HTML()
        self.info = w.HTML()
        self.view = FigureView(max_width=figure_px, max_height=figure_px)
        self.grid = self.halo = self.error = None
        self._refresh_tiles()

    def geometry(self) -> tuple[TileGrid, LayerHalo]:
        """The grid the controls choose and the chosen layer's halo on it (a ConfigError when it cannot)."""
        raise NotImplementedError

    def status_text(self, halo: LayerHalo) -> str:
        """The status line (HTML) for a grid that carries the layer."""
        raise NotImplementedError

    def draw(self) -> Figure:
        """The figure for the current grid, halo and tile choice."""
        raise NotImplementedError

    def describe(self) -> str:
        """The selected tiles' halos and messages as text."""
        raise NotImplementedError

    def grid_parts(self) -> int:
        """How many tiles the chosen grid has."""
        raise NotImplementedError

    def _refresh_tiles(self) -> None:
        parts = self.grid_parts()
        current = self.tile_choice.value if self.tile_choice.options else -1
        self._updating = True
        self.tile_choice.options = [("all", -1)] + [(f"tile {t}", t) for t in range(parts)]
        self.tile_choice.value = current if current is not None and current < parts else -1
        self._updating = False

    def _grid_changed(self, change: Mapping[str, object]) -> None:
        self._refresh_tiles()
        self.update()

    @property
    def selected_tiles(self) -> list[int] | None:
        tile = self.tile_choice.value
        return None if tile is None or tile < 0 else [tile]

    def update(self) -> None:
        """Recompute the geometry and redraw."""
        if self._updating:
            return
        try:
            self.grid, self.halo = self.geometry()
        except ConfigError as exc:
            self.halo, self.error = None, str(exc)
            self.status.value = f"<b style='color:#b00'>&#10007; {html.escape(str(exc))}</b>"
            self.view.clear()             # the old figure and text belong to other settings
            self.info.value = ""
            return
        self.error = None
        self.status.value = self.status_text(self.halo)
        self.view.show(self.draw())
        self.info.value = "<pre>" + html.escape(self.describe()) + "</pre>"
