"""VolumeHaloViewer: a slice through a volume's 3-D tile grid, one layer's halo faces and the in-plane messages."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ipywidgets as w
from matplotlib.figure import Figure
from torch import nn

from ...config import ConfigError, volume_slices
from ...spatial.geometry import LayerHalo, TileGrid, Window1d
from .. import viz
from .figure_view import display_widget
from .halo_viewer import FIGURE_PX, window_calls
from .tile_halo_view import TileHaloView

if TYPE_CHECKING:
    import numpy as np
    import torch

GRIDS = ("2x2x2", "1x2x2", "2x1x1", "4x1x1", "1x1x4", "3x2x1", "2x2x1")   # the grid menu's cuts (depth x rows x cols)
VOLUME_KINDS = (nn.Conv3d, nn.MaxPool3d, nn.AvgPool3d)


@dataclass(frozen=True)
class VolumeLayer:
    """A 3-D conv/pool layer as the halo geometry sees it: its input's (depth, height, width) and window."""

    name: str
    sizes: tuple[int, int, int]
    kernel: tuple[int, int, int]
    stride: tuple[int, int, int] = (1, 1, 1)
    padding: tuple[int, int, int] = (0, 0, 0)
    dilation: tuple[int, int, int] = (1, 1, 1)

    def halo(self, grid: TileGrid) -> LayerHalo:
        windows = [Window1d(k, s, d, p, p) for k, s, d, p in zip(self.kernel, self.stride, self.dilation,
                                                                 self.padding)]
        return LayerHalo.for_axis_windows(grid, self.sizes, windows, self.name)

    @property
    def label(self) -> str:
        dilation = f" d{self.dilation[0]}" if self.dilation[0] > 1 else ""
        return (f"{self.name} ({'x'.join(map(str, self.sizes))}, k{self.kernel[0]} s{self.stride[0]} "
                f"p{self.padding[0]}{dilation})")


def _triple(values: tuple[int, ...]) -> tuple[int, int, int]:
    depth, rows, cols = values
    return (depth, rows, cols)


def volume_layers(layers: Sequence[nn.Module] | nn.Module, volume_size: int | tuple[int, int, int],
                  in_channels: int = 1) -> list[VolumeLayer]:
    """Every Conv3d / MaxPool3d / AvgPool3d with a window > 1 or a stride, with its input's sizes (one
    forward pass of a ``volume_size`` volume on the meta device)."""
    model = nn.Sequential(*layers) if not isinstance(layers, nn.Module) else layers
    sizes = (volume_size,) * 3 if isinstance(volume_size, int) else volume_size
    return [VolumeLayer(call.name, _triple(call.sizes), _triple(call.kernel), _triple(call.stride),
                        _triple(call.padding), _triple(call.dilation))
            for call in window_calls(model, (1, in_channels, *sizes), VOLUME_KINDS)]


def face_text(grid: TileGrid, halo: LayerHalo, tile: int) -> str:
    """A tile's owned ranges, its halo per face and its messages, as lines of text."""
    th = halo.tile(tile)
    widths = viz.face_halos(th)
    ranges = ", ".join(f"{axis} {extent}" for axis, extent in zip(("depth", "rows", "cols"), th.owned_extent))
    lines = [f"tile {tile} (depth, row, col) {grid.coords(tile)}: owns {ranges}",
             "   halo per face: " + ", ".join(f"{face} {widths[face]}" for face in viz.FACES)]
    for msg in halo.messages(tile):
        arrow, other = ("sends", f"to tile {msg.dst}") if msg.src == tile else ("receives", f"from tile {msg.src}")
        lines.append(f"   {arrow} {msg.phase} phase: slices {msg.depth} box {msg.box} ({msg.elements} voxels) {other}")
    return "\n".join(lines)


class VolumeHaloViewer(TileHaloView):
    """Pick a layer, a grid (``DxRxC``), a tile and a slice; see the slice of ``volume`` with the tiles that own
    it and the halo the chosen tile receives there: in-plane bands on its own slices, a face (front/back, from
    its depth neighbour) on the slices of its depth halo.

    ``volume``: a tensor ``(D, H, W)`` / ``(C, D, H, W)`` or an array ``(D, H, W)`` / ``(D, H, W, C)``.
    ``layers``: VolumeLayer specs, or a 3-D model's layer list (``volume_layers`` finds its Conv3d / pools).
    State: ``grid``, ``halo`` (geometry.LayerHalo shown), ``error`` (why the grid cannot carry the layer),
    ``view.figure``, ``info`` (the tiles' faces and messages as text).
    """

    def __init__(self, volume: np.ndarray | torch.Tensor, layers: Sequence[VolumeLayer | nn.Module] | None = None,
                 *, grid: str = "2x2x2", in_channels: int = 1, depth_index: int | None = None) -> None:
        self.volume = volume
        depth = viz.volume_depth(volume)
        sizes = (depth, *viz.volume_slice(volume, 0).shape[:2])
        if layers is None:
            self.layers = [VolumeLayer("conv 3x3x3", _triple(sizes), (3, 3, 3), padding=(1, 1, 1))]
        else:
            specs = [item for item in layers if isinstance(item, VolumeLayer)]
            modules = [item for item in layers if isinstance(item, nn.Module)]
            if len(specs) < len(layers) and len(modules) < len(layers):
                raise TypeError("layers: a list of VolumeLayer specs, or a 3-D model's layer list (nn.Module)")
            self.layers = specs if specs else volume_layers(modules, _triple(sizes), in_channels)
        if not self.layers:
            raise ValueError("no Conv3d/MaxPool3d/AvgPool3d with a window found; pass VolumeLayer specs")
        if volume_slices(grid) is None:
            raise ConfigError("grid", f"{grid!r} is not a volume's grid; write it depth x rows x cols, e.g. 2x2x2")
        self.layer_choice = w.Dropdown(options=[(layer.label, i) for i, layer in enumerate(self.layers)], value=0,
                                       description="layer", layout=w.Layout(width="460px"))
        self.grid_choice = w.Dropdown(options=list(dict.fromkeys((grid, *GRIDS))), value=grid, description="grid")
        self.depth_slider = w.IntSlider(value=depth // 2 if depth_index is None else depth_index, min=0,
                                        max=depth - 1, description="slice", continuous_update=False)
        self.messages_box = w.Checkbox(value=True, description="show messages")
        self.start_view(FIGURE_PX)
        for control in (self.layer_choice, self.tile_choice, self.depth_slider, self.messages_box):
            control.observe(lambda change: self.update(), names="value")
        self.grid_choice.observe(self._grid_changed, names="value")
        self.widget = w.VBox([w.HBox([self.layer_choice, self.tile_choice]),
                              w.HBox([self.grid_choice, self.depth_slider, self.messages_box]),
                              self.status,
                              w.HBox([self.view.widget, self.info],
                                     layout=w.Layout(flex_flow="row wrap", align_items="flex-start"))])
        self.update()

    def _shape(self) -> tuple[int, int, int]:
        shape = volume_slices(self.grid_choice.value)
        assert shape is not None           # the menu holds volume grids only
        return shape

    def grid_parts(self) -> int:
        depth, rows, cols = self._shape()
        return depth * rows * cols

    def geometry(self) -> tuple[TileGrid, LayerHalo]:
        depth, rows, cols = self._shape()
        grid = TileGrid(rows, cols, depth=depth)
        return grid, self.layers[self.layer_choice.value].halo(grid)

    def status_text(self, halo: LayerHalo) -> str:
        return (f"{html.escape(self.layers[self.layer_choice.value].name)}: three phases (depth, then rows, then "
                f"columns: edges and corners travel in the later phases); {halo.message_count} messages")

    def draw(self) -> Figure:
        assert self.grid is not None and self.halo is not None
        return viz.draw_volume_tiles_and_halos(self.volume, self.grid, self.halo, depth_index=self.depth_slider.value,
                                               tiles=self.selected_tiles, show_messages=self.messages_box.value)

    def describe(self) -> str:
        """The selected tiles' owned ranges, halo per face and messages."""
        assert self.halo is not None and self.grid is not None
        tiles = self.selected_tiles or list(range(self.grid.num_tiles))
        return "\n".join(face_text(self.grid, self.halo, t) for t in tiles)

    def _ipython_display_(self) -> None:  # pragma: no cover - display only
        display_widget(self.widget)
