"""AttentionViewer: pick a query token of a ViT on token tiles; see which rank's keys arrive at which ring step
and its attention map across the tile seams over the image."""

from __future__ import annotations

from collections.abc import Callable

import ipywidgets as w
import numpy as np
import torch
from matplotlib.figure import Figure

from ..attention_view import RingTokens, draw_query_attention, draw_ring_arrivals
from .figure_view import FigureView, display_widget

Weights = Callable[[int], np.ndarray]   # query token -> its attention weights over every token (one process's order)


class AttentionViewer:
    """A query chosen as 'class token' or a grid token's row and column; ``weights`` gives its attention.

    State: ``query`` (the token, one process's numbering), ``view.figure`` (ring steps above, map below).
    """

    def __init__(self, image: np.ndarray | torch.Tensor, tiles: RingTokens, weights: Weights) -> None:
        self.image, self.tiles, self.weights = image, tiles, weights
        tokens = tiles.tokens
        kinds = ["class token", "grid token"] if tokens.prefix else ["grid token"]
        self.kind = w.ToggleButtons(options=kinds, description="query")
        self.row = w.IntSlider(value=tokens.rows // 2, min=0, max=tokens.rows - 1, description="token row")
        self.col = w.IntSlider(value=tokens.cols // 2, min=0, max=tokens.cols - 1, description="token col")
        self.view = FigureView()
        for control in (self.kind, self.row, self.col):
            control.observe(lambda change: self.refresh(), names="value")
        self.widget = w.VBox([self.kind, w.HBox([self.row, self.col]), self.view.widget])
        self.refresh()

    @property
    def query(self) -> int:
        tokens = self.tiles.tokens
        if self.kind.value == "class token":
            return 0
        return tokens.prefix + self.row.value * tokens.cols + self.col.value

    def figure(self) -> Figure:
        """The ring's steps for the query (top) and its attention over the image (below)."""
        steps = self.tiles.grid.num_tiles
        fig = Figure(figsize=(max(6.0, 1.7 * steps), 7.4))
        spec = fig.add_gridspec(2, steps, height_ratios=(1, 3.2))
        draw_ring_arrivals(self.tiles, self.query, [fig.add_subplot(spec[0, i]) for i in range(steps)])
        draw_query_attention(self.image, self.tiles, self.weights(self.query), self.query,
                             fig.add_subplot(spec[1, :]))
        return fig

    def refresh(self) -> None:
        self.row.disabled = self.col.disabled = self.kind.value == "class token"
        self.view.show(self.figure())

    def _ipython_display_(self) -> None:  # pragma: no cover - display only
        display_widget(self.widget)
