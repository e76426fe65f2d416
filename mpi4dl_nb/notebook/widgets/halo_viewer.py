"""HaloViewer: an image (or a slice of a volume) with the tile grid, one layer's halo and the messages."""

from __future__ import annotations

import copy
import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ipywidgets as w
import torch
from matplotlib.figure import Figure
from torch import nn

from ...config import SLICE_METHODS, SliceMethod, volume_slices
from ...errors import ConfigError
from ...spatial.geometry import KernelAxis, LayerHalo, TileGrid
from .. import viz
from .figure_view import FigureView, display_widget

if TYPE_CHECKING:
    import numpy as np

FIGURE_PX = 460      # the figure's side on screen: controls + figure fit a 1366x768 laptop screen
VOLUME_GRIDS = ("2x2x2", "1x2x2", "2x1x1", "4x1x1", "1x1x4", "3x2x1", "2x2x1")   # a volume's grid menu (DxRxC)
TRIM_NOTE = ("a negative halo is a trim: with a stride, a tile's own edge rows/cols that none of its outputs "
             "read are cut off locally (nothing is sent)")
KINDS = {2: (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d), 3: (nn.Conv3d, nn.MaxPool3d, nn.AvgPool3d)}   # by axes


def axis_values(value: object, count: int = 2) -> tuple[int, ...]:
    """A layer's kernel/stride/padding/dilation as one int per spatial axis (``count``: 2 or 3)."""
    if isinstance(value, int):
        return (value,) * count
    if isinstance(value, tuple) and len(value) == count:
        return tuple(int(item) for item in value)
    raise TypeError(f"{value!r} is neither an int nor {count} ints")


@dataclass(frozen=True)
class WindowedLayer:
    """A conv/pool layer as the halo geometry sees it: its input's sizes (``(H, W)``, a volume's ``(D, H, W)``)
    and its window per axis (stride, padding and dilation default to 1, 0, 1)."""

    name: str
    sizes: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...] = ()
    padding: tuple[int, ...] = ()
    dilation: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.sizes, tuple):
            raise TypeError(f"WindowedLayer({self.name!r}, {self.sizes!r}, ...): give the input's sizes as one "
                            f"tuple: WindowedLayer(name, (height, width), kernel, stride, padding, dilation), or "
                            f"(depth, height, width) for a volume's layer")
        axes = len(self.sizes)
        for field, default in (("kernel", 1), ("stride", 1), ("padding", 0), ("dilation", 1)):
            value = getattr(self, field)
            object.__setattr__(self, field, axis_values(value if value != () else default, axes))

    @property
    def height(self) -> int:
        return self.sizes[-2]

    @property
    def width(self) -> int:
        return self.sizes[-1]

    def halo(self, grid: TileGrid) -> LayerHalo:
        windows = [KernelAxis(k, s, d, p, p) for k, s, d, p in zip(self.kernel, self.stride, self.dilation,
                                                                 self.padding)]
        return LayerHalo.for_axis_windows(grid, self.sizes, windows, self.name)

    @property
    def label(self) -> str:
        dilation = f" d{self.dilation[0]}" if self.dilation[0] > 1 else ""
        return (f"{self.name} ({'x'.join(map(str, self.sizes))}, k{self.kernel[0]} s{self.stride[0]} "
                f"p{self.padding[0]}{dilation})")


WindowModule = nn.modules.conv._ConvNd | nn.modules.pooling._MaxPoolNd | nn.modules.pooling._AvgPoolNd   # a window


def window_calls(model: nn.Module, input_shape: Sequence[int],
                 kinds: tuple[type[WindowModule], ...]) -> list[WindowedLayer]:
    """Every call of a ``kinds`` layer in ``model`` with a window > 1 or a stride, with its input's sizes (one
    forward pass of a ``input_shape`` (N, C, *spatial) input on the meta device); string padding is skipped."""
    model = copy.deepcopy(model).to("meta")
    count = len(input_shape) - 2
    found: list[WindowedLayer] = []

    def hook_for(name: str) -> Callable[[WindowModule, tuple[object, ...]], None]:
        def hook(module: WindowModule, inputs: tuple[object, ...]) -> None:
            x, padding = inputs[0], module.padding
            if not isinstance(x, torch.Tensor) or isinstance(padding, str):
                return      # 'same'/'valid' string padding: not a windowed-halo layer we draw
            kernel = axis_values(module.kernel_size, count)
            stride = axis_values(module.stride if module.stride is not None else kernel, count)
            if kernel == (1,) * count and stride == (1,) * count:
                return
            found.append(WindowedLayer(name, tuple(int(n) for n in x.shape[-count:]), kernel, stride,
                                       axis_values(padding, count),
                                       axis_values(getattr(module, "dilation", 1), count)))
        return hook

    handles = [module.register_forward_pre_hook(hook_for(name)) for name, module in model.named_modules()
               if isinstance(module, kinds)]
    try:
        model(torch.empty(*input_shape, device="meta"))
    finally:
        for handle in handles:
            handle.remove()
    return found


def windowed_layers(layers: Sequence[nn.Module] | nn.Module, size: int | Sequence[int],
                    in_channels: int | None = None) -> list[WindowedLayer]:
    """Every conv / max pool / avg pool with a window > 1 or a stride, with its input's sizes (one forward pass on
    the meta device of a ``size`` input: an int for a square image or a cube, or the sizes). A model with 3-D
    layers is a volume's; ``in_channels`` defaults to its first conv's."""
    model = nn.Sequential(*layers) if not isinstance(layers, nn.Module) else layers
    modules = list(model.modules())
    axes = 3 if any(isinstance(m, KINDS[3]) for m in modules) else 2
    sizes = (size,) * axes if isinstance(size, int) else tuple(size)
    if in_channels is None:
        first = next((m for m in modules if isinstance(m, nn.modules.conv._ConvNd)), None)
        in_channels = first.in_channels if first is not None else 1
    return window_calls(model, (1, in_channels, *sizes), KINDS[axes])


DEFAULT_LAYERS = (   # at the image's size
    WindowedLayer("conv 3x3", (512, 512), (3, 3), (1, 1), (1, 1)),
    WindowedLayer("conv 7x7 stride 2", (512, 512), (7, 7), (2, 2), (3, 3)),
    WindowedLayer("conv 3x3 dilation 4", (512, 512), (3, 3), (1, 1), (4, 4), (4, 4)),
    WindowedLayer("max pool 3x3 stride 2", (512, 512), (3, 3), (2, 2), (1, 1)),
)


def halo_text(halo: dict[str, int], padding: dict[str, int]) -> str:
    """Halo per side in words: rows/cols received from neighbours, trimmed (negative halo), zero-padded.

    ``halo`` counts padding in (as ``TileHalo.halo`` does); ``padding`` is the zero padding at the image border.
    """
    added = [f"{side} {width - padding[side]}" for side, width in halo.items() if width - padding[side] > 0]
    trimmed = [f"{side} {-width}" for side, width in halo.items() if width < 0]
    padded = [f"{side} {width}" for side, width in padding.items() if width > 0]
    parts = [f"receives {', '.join(added) if added else 'nothing'}"]
    if trimmed:
        parts.append(f"trims {', '.join(trimmed)} (own rows/cols no output reads)")
    if padded:
        parts.append(f"zero padding {', '.join(padded)} (image border)")
    return "; ".join(parts)


def tile_text(grid: TileGrid, halo: LayerHalo, tile: int) -> str:
    """A tile's owned ranges, its halo per side (a volume's: per face) and its messages, as lines of text."""
    th = halo.tile(tile)
    if th.depth is None:
        lines = [f"tile {tile}: owns rows {th.rows.owned} cols {th.cols.owned}; {halo_text(th.halo, th.padding)}"]
        unit = "px"
    else:
        widths = viz.face_halos(th)
        ranges = ", ".join(f"{axis} {extent}" for axis, extent in zip(grid.axis_names, th.owned_extent))
        lines = [f"tile {tile} (depth, row, col) {grid.coords(tile)}: owns {ranges}",
                 "   halo per face: " + ", ".join(f"{face} {widths[face]}" for face in viz.FACES)]
        unit = "voxels"
    for msg in halo.messages(tile):
        arrow, other = ("sends", f"to tile {msg.dst}") if msg.src == tile else ("receives", f"from tile {msg.src}")
        slices = "" if msg.depth is None else f" phase: slices {msg.depth}"
        lines.append(f"   {arrow} {msg.phase}{slices} box {msg.box} ({msg.elements} {unit}) {other}")
    return "\n".join(lines)


def _picture_side(image: np.ndarray | torch.Tensor) -> int:
    """Height of an HxW(xC) array or a CxHxW tensor."""
    is_chw = isinstance(image, torch.Tensor) and image.ndim == 3
    return int(image.shape[1] if is_chw else image.shape[0])


class HaloViewer:
    """Pick a layer, a grid and a tile (a volume's grid: and a slice); see the image, or the volume's slice, with
    the tiles (that own it), the halo bands the chosen tiles receive there (corners hatched; a volume's slice in a
    tile's depth halo: the face, with its edges hatched) and arrows of the in-plane messages.

    ``picture``: an image (HxWxC array or CHW tensor); a volume (a tensor ``(D, H, W)`` / ``(C, D, H, W)``, an
    array ``(D, H, W)`` / ``(D, H, W, C)``) when ``slice_method`` is a volume's grid ``"DxRxC"``. ``layers``:
    WindowedLayer specs, or a model's layer list (``windowed_layers`` finds its convs/pools at ``image_size``, a
    volume's at its own sizes). ``slice_method``/``num_spatial_parts`` choose the grid (a volume's ``DxRxC``
    fixes the count); ``depth_index``: the volume's slice shown first (default: the middle one).
    State: ``grid``, ``halo`` (geometry.LayerHalo shown), ``error`` (why the grid cannot carry the layer),
    ``view.figure``, ``info`` (the tiles' halos and messages as text).
    """

    def __init__(self, picture: np.ndarray | torch.Tensor, layers: Sequence[WindowedLayer | nn.Module] | None = None,
                 *, image_size: int | None = None, slice_method: SliceMethod | str = SliceMethod.SQUARE,
                 num_spatial_parts: int = 4, in_channels: int | None = None, depth_index: int | None = None) -> None:
        self.picture = picture
        self.volume = volume_slices(str(slice_method)) is not None
        self.layers = self._layers(layers, image_size, in_channels)
        self.layer_choice = w.Dropdown(options=[(f"{i}: {layer.label}", i) for i, layer in enumerate(self.layers)],
                                       value=0, description="layer", layout=w.Layout(width="460px"))
        methods = list(dict.fromkeys((str(slice_method), *VOLUME_GRIDS))) if self.volume else list(SLICE_METHODS)
        self.slice_choice = w.Dropdown(options=methods, value=str(slice_method), description="slice")
        self.parts_choice = w.BoundedIntText(value=num_spatial_parts, min=1, max=64, description="parts")
        depth = viz.volume_depth(picture) if self.volume else 1
        self.depth_slider = w.IntSlider(value=depth // 2 if depth_index is None else depth_index, min=0,
                                        max=depth - 1, description="depth", continuous_update=False)
        self.messages_box = w.Checkbox(value=True, description="show messages")
        self.tile_choice = w.Dropdown(description="tile")
        self.status, self.info = w.HTML(), w.HTML()
        self.view = FigureView(max_width=FIGURE_PX, max_height=FIGURE_PX)
        self.grid: TileGrid | None = None
        self.halo: LayerHalo | None = None
        self.error: str | None = None
        self._updating = False
        self._refresh_tiles()
        for control in (self.layer_choice, self.tile_choice, self.depth_slider, self.messages_box):
            control.observe(lambda change: self.update(), names="value")
        for control in (self.slice_choice, self.parts_choice):
            control.observe(lambda change: self._grid_changed(), names="value")
        third = self.depth_slider if self.volume else self.parts_choice
        self.widget = w.VBox([w.HBox([self.layer_choice, self.tile_choice]),
                              w.HBox([self.slice_choice, third, self.messages_box]), self.status,
                              w.HBox([self.view.widget, self.info],
                                     layout=w.Layout(flex_flow="row wrap", align_items="flex-start"))])
        self.update()

    def _layers(self, layers: Sequence[WindowedLayer | nn.Module] | None, image_size: int | None,
                in_channels: int | None) -> list[WindowedLayer]:
        """The layers of the menu: given specs, a model's windowed layers at the picture's size, or the defaults."""
        if self.volume:
            sizes: tuple[int, ...] = (viz.volume_depth(self.picture), *viz.volume_slice(self.picture, 0).shape[:2])
        else:
            side = image_size or _picture_side(self.picture)
            sizes = (side, side)
        if layers is None:
            found = [WindowedLayer("conv 3x3x3", sizes, (3, 3, 3), padding=(1, 1, 1))] if self.volume else [
                WindowedLayer(item.name, sizes, item.kernel, item.stride, item.padding, item.dilation)
                for item in DEFAULT_LAYERS]
        else:
            specs = [item for item in layers if isinstance(item, WindowedLayer)]
            modules = [item for item in layers if isinstance(item, nn.Module)]
            if len(specs) < len(layers) and len(modules) < len(layers):
                raise TypeError("layers: a list of WindowedLayer specs, or a model's layer list (nn.Module)")
            found = specs if specs else windowed_layers(modules, sizes, in_channels)
        if not found:
            raise ValueError("no conv/pool layer with a window found; pass WindowedLayer specs")
        return found

    def grid_parts(self) -> int:
        """How many tiles the chosen grid has."""
        shape = volume_slices(self.slice_choice.value)
        return int(self.parts_choice.value) if shape is None else shape[0] * shape[1] * shape[2]

    def geometry(self) -> tuple[TileGrid, LayerHalo]:
        """The grid the controls choose and the chosen layer's halo on it (a ConfigError when it cannot)."""
        grid = TileGrid.from_slice_method(self.slice_choice.value, self.grid_parts())
        return grid, self.layers[self.layer_choice.value].halo(grid)

    def status_text(self, halo: LayerHalo) -> str:
        """The status line (HTML) for a grid that carries the layer."""
        trims = any(width < 0 for th in halo for width in th.halo.values())
        phases = ", then ".join(halo.grid.axis_names)
        return (f"{html.escape(self.layers[self.layer_choice.value].name)}: one phase per axis ({phases}: edges "
                f"and corners travel in the later phases); {halo.message_count} messages"
                + (f"; {TRIM_NOTE}" if trims else ""))

    def draw(self) -> Figure:
        assert self.grid is not None and self.halo is not None
        return viz.draw_tiles_and_halos(self.picture, self.grid, self.halo,
                                        depth_index=self.depth_slider.value if self.volume else None,
                                        tiles=self.selected_tiles, show_messages=self.messages_box.value)

    def describe(self) -> str:
        """The selected tiles' halos and messages as text."""
        assert self.halo is not None and self.grid is not None
        tiles = self.selected_tiles or list(range(self.grid.num_tiles))
        return "\n".join(tile_text(self.grid, self.halo, t) for t in tiles)

    @property
    def selected_tiles(self) -> list[int] | None:
        tile = self.tile_choice.value
        return None if tile is None or tile < 0 else [tile]

    def _refresh_tiles(self) -> None:
        parts = self.grid_parts()
        current = self.tile_choice.value if self.tile_choice.options else -1
        self._updating = True
        self.tile_choice.options = [("all", -1)] + [(f"tile {t}", t) for t in range(parts)]
        self.tile_choice.value = current if current is not None and current < parts else -1
        self._updating = False

    def _grid_changed(self) -> None:
        self._refresh_tiles()
        self.update()

    def update(self) -> None:
        """Recompute the geometry and redraw; a grid that cannot carry the layer shows its ConfigError instead of
        a stale figure."""
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

    def _ipython_display_(self) -> None:  # pragma: no cover - display only
        display_widget(self.widget)
