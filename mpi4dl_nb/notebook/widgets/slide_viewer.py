"""SlideViewer: an inference heat map (or a whole-slide model's attention map, ``from_map``) over its slide,
zoomable by pyramid level, with a cell inspector and, optionally, GeoJSON polygons outlined over the tissue."""

from __future__ import annotations

from pathlib import Path

import ipywidgets as w
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .figure_view import FigureView, display_widget

VIEW_SIDE = 640   # pixels of the chosen level shown at once


class SlideViewer:
    """The slide at a chosen level with the heat map of one class laid over it, and one cell inspected.

    ``probabilities``: the ``(classes, H', W')`` array ``infer`` writes (a path to the .npy,
    memory-mapped, or an array); ``stride``/``field`` from its summary (``summary["output_stride"]``,
    ``summary["field"]["rows"]``): cell ``(i, j)`` reads level-``slide_level`` pixels
    ``[i*stride - before, i*stride + after)`` (rows; columns alike). Controls: pyramid level,
    centre of the view (fractions of the slide), opacity, class; ``select(x, y)`` (slide pixels)
    or the cell boxes pick the cell whose patch and class probabilities are shown; ``cell`` is
    the picked ``(row, col)``. ``polygons``: a GeoJSON FeatureCollection (``infer --output m.geojson``, or
    QuPath's export; level-0 pixel coordinates) whose regions are outlined over the slide, each class in its
    colour among ``classes`` (the order ``infer`` colours them by); ``show_polygons`` switches them off.
    """

    def __init__(self, slide: str | Path, probabilities: str | Path | np.ndarray, *, stride: float,
                 field: tuple[float, float] = (0, 0), slide_level: int = 0, classes: list[str] | None = None,
                 polygons: str | Path | None = None) -> None:
        from ...data.geojson import read_annotations
        from ...infer.reader import SlideReader

        self.reader = SlideReader(slide, slide_level)
        self.base = SlideReader(slide, 0)
        self.probs = np.load(probabilities, mmap_mode="r") if isinstance(probabilities, (str, Path)) \
            else np.asarray(probabilities)
        self.stride, self.before, self.after = stride, field[0], field[1]
        count = self.probs.shape[0]
        self.classes = classes or [f"class {c}" for c in range(count)]
        levels = [(f"{i}: {w_}x{h}", i) for i, (w_, h) in enumerate(self.base.levels)]
        self.level = w.Dropdown(options=levels, value=len(levels) - 1, description="level")
        self.center_x = w.FloatSlider(value=0.5, min=0, max=1, step=0.01, description="centre x")
        self.center_y = w.FloatSlider(value=0.5, min=0, max=1, step=0.01, description="centre y")
        self.opacity = w.FloatSlider(value=0.5, min=0, max=1, step=0.05, description="opacity")
        self.heat_class = w.Dropdown(options=[(n, i) for i, n in enumerate(self.classes)], value=count - 1,
                                     description="class")
        self.cell_row = w.BoundedIntText(value=self.probs.shape[1] // 2, min=0, max=self.probs.shape[1] - 1,
                                         description="cell row")
        self.cell_col = w.BoundedIntText(value=self.probs.shape[2] // 2, min=0, max=self.probs.shape[2] - 1,
                                         description="cell col")
        self.info = w.HTML()
        self.regions = () if polygons is None else read_annotations(polygons).regions
        self.show_polygons = w.Checkbox(value=bool(self.regions), description=f"polygons ({len(self.regions)})",
                                        disabled=not self.regions)
        self.view, self.inspector = FigureView(), FigureView()
        for control in (self.level, self.center_x, self.center_y, self.opacity, self.heat_class, self.show_polygons):
            control.observe(lambda change: self.draw(), names="value")
        self._picking = False
        for control in (self.cell_row, self.cell_col):
            control.observe(lambda change: None if self._picking else self.inspect(), names="value")
        self.widget = w.VBox([w.HBox([self.level, self.heat_class, self.opacity]),
                              w.HBox([self.center_x, self.center_y, self.show_polygons]),
                              w.HBox([self.view.widget, w.VBox([w.HBox([self.cell_row, self.cell_col]),
                                                                self.info, self.inspector.widget])])])
        self.draw()
        self.inspect()

    @classmethod
    def from_map(cls, slide: str | Path, map_tiff: str | Path, *, polygons: str | Path | None = None) -> SlideViewer:
        """A slide-aligned map OME-TIFF of ``infer --slides ... --output DIR`` with a whole-slide model
        (``DIR/<slide>.attention.ome.tif``, ``.max-share.ome.tif``) laid over its ``slide`` at level 0, each channel
        shown relative to its highest cell (attention weights sum to 1 over the canvas, so they are small);
        ``polygons``: the map's ``.geojson`` regions. Map pixel ``(i, j)`` covers level-0 pixels
        ``[i*s, (i+1)*s)``, ``s`` the map's MPP over the slide's (else the ratio of their widths)."""
        from ...infer.outputs.slide_level import read_slide_map
        from ...infer.reader import SlideReader

        stored = read_slide_map(map_tiff)
        base = SlideReader(slide, 0)
        try:
            level0_mpp, width = base.base_mpp, base.width
        finally:
            base.close()
        stride = stored.mpp / level0_mpp if stored.mpp is not None and level0_mpp else width / stored.values.shape[-1]
        peak = np.nanmax(stored.values, axis=(1, 2), keepdims=True)
        shown = stored.values / np.where(peak > 0, peak, 1.0)
        return cls(slide, shown, stride=stride, field=(0, stride), classes=list(stored.names), polygons=polygons)

    # ----------------------------------------------------------------- geometry
    @property
    def cell(self) -> tuple[int, int]:
        return (int(self.cell_row.value), int(self.cell_col.value))

    def scale(self) -> float:
        """Pixels of the heat map's level per pixel of the displayed level."""
        shown = self.base.levels[self.level.value]
        return self.reader.width / shown[0]

    def viewport(self) -> tuple[int, int, int, int]:
        """(x0, y0, width, height) shown, in pixels of the displayed level."""
        width, height = self.base.levels[self.level.value]
        vw, vh = min(width, VIEW_SIDE), min(height, VIEW_SIDE)
        x0 = int(round(self.center_x.value * width - vw / 2))
        y0 = int(round(self.center_y.value * height - vh / 2))
        return (min(max(x0, 0), width - vw), min(max(y0, 0), height - vh), vw, vh)

    def cell_box(self, row: int, col: int) -> tuple[float, float, float, float]:
        """(x0, y0, x1, y1) of a cell's field in heat-map-level pixels."""
        s = self.stride
        return (col * s - self.before, row * s - self.before, col * s + self.after, row * s + self.after)

    def select(self, x: float, y: float) -> tuple[int, int]:
        """Pick the cell whose field is centred nearest to pixel ``(x, y)`` of the heat map's level (a click)."""
        centre = (self.after - self.before) / 2
        row = int(np.clip(round((y - centre) / self.stride), 0, self.probs.shape[1] - 1))
        col = int(np.clip(round((x - centre) / self.stride), 0, self.probs.shape[2] - 1))
        self._picking = True
        try:
            self.cell_row.value, self.cell_col.value = row, col
        finally:
            self._picking = False
        self.inspect()
        return row, col

    # ------------------------------------------------------------------ drawing
    def draw(self) -> Figure:
        from ...infer.outputs.colors import colorize, colormap_lut
        from ...infer.reader import SlideReader

        level = self.level.value
        x0, y0, vw, vh = self.viewport()
        shown = SlideReader(self.base.path, level)
        image = shown.read((y0, y0 + vh, x0, x0 + vw))
        shown.close()
        k = self.scale()
        s = self.stride / k                              # displayed pixels per cell
        centre = (self.after - self.before - self.stride) / 2 / k   # cell blocks centred on their fields
        c0 = max(0, int(np.floor((x0 - centre) / s)))
        r0 = max(0, int(np.floor((y0 - centre) / s)))
        c1 = min(self.probs.shape[2], int(np.ceil((x0 + vw - centre) / s)) + 1)
        r1 = min(self.probs.shape[1], int(np.ceil((y0 + vh - centre) / s)) + 1)
        step = max(1, int(1 / max(s, 1e-9)))
        heat = np.asarray(self.probs[self.heat_class.value, r0:r1:step, c0:c1:step], dtype=np.float32)
        rgba = np.dstack([colorize(heat, colormap_lut()) / 255.0, np.where(np.isfinite(heat), self.opacity.value, 0)])
        figure = Figure(figsize=(6, 6 * vh / max(vw, 1)))
        ax = figure.add_subplot()
        ax.imshow(image, extent=(x0, x0 + vw, y0 + vh, y0))
        ax.imshow(rgba, extent=(c0 * s + centre, c1 * s + centre, r1 * s + centre, r0 * s + centre),
                  interpolation="nearest")
        bx0, by0, bx1, by1 = (v / k for v in self.cell_box(*self.cell))
        ax.add_patch(_rectangle(bx0, by0, bx1 - bx0, by1 - by0))
        if self.show_polygons.value:
            self._outline(ax)
        ax.set_xlim(x0, x0 + vw)
        ax.set_ylim(y0 + vh, y0)
        ax.set_title(f"{self.classes[self.heat_class.value]} probability, level {level}", fontsize=9)
        self.view.show(figure)
        return figure

    def _outline(self, ax: Axes) -> None:
        """The polygons' rings (level-0 pixels) drawn at the displayed level, one colour and legend entry per class."""
        from ...infer.outputs.colors import class_color

        level0_per_shown = self.base.levels[0][0] / self.base.levels[self.level.value][0]
        names = list(dict.fromkeys([*self.classes, *(r.name for r in self.regions)]))
        labelled: set[str] = set()
        for region in self.regions:
            colour = tuple(c / 255 for c in class_color(names.index(region.name)))
            for ring in region.rings:
                closed = ring if np.array_equal(ring[0], ring[-1]) else np.vstack([ring, ring[:1]])
                shown = closed / level0_per_shown
                ax.plot(shown[:, 0], shown[:, 1], color=colour, linewidth=1.2,
                        label=None if region.name in labelled else region.name)
                labelled.add(region.name)
        if labelled:
            ax.legend(loc="upper right", fontsize=7, framealpha=0.8)

    def inspect(self) -> Figure:
        """The picked cell's field (slide pixels) and its class probabilities."""
        row, col = self.cell
        x0, y0, x1, y1 = (int(round(v)) for v in self.cell_box(row, col))
        patch = self.reader.read((y0, y1, x0, x1))
        values = np.asarray(self.probs[:, row, col], dtype=np.float64)
        figure = Figure(figsize=(3.2, 4.6))
        top, bottom = figure.add_subplot(2, 1, 1), figure.add_subplot(2, 1, 2)
        top.imshow(patch)
        top.set_title(f"cell ({row}, {col}): pixels [{x0}, {x1}) x [{y0}, {y1})", fontsize=8)
        top.axis("off")
        bottom.barh(self.classes, np.nan_to_num(values), color="#c2410c")
        bottom.set_xlim(0, 1)
        bottom.set_xlabel("probability")
        self.info.value = ("not computed (background)" if np.isnan(values).any() else
                           ", ".join(f"{n}: {v:.3f}" for n, v in zip(self.classes, values)))
        self.inspector.show(figure)
        self.draw()
        return figure

    def _ipython_display_(self) -> None:  # pragma: no cover - display only
        display_widget(self.widget)


def _rectangle(x: float, y: float, width: float, height: float) -> Rectangle:
    return Rectangle((x, y), width, height, fill=False, edgecolor="#22d3ee", linewidth=1.5)
