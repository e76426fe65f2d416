"""HaloViewer: a pathology image with the tile grid, one layer's halo bands and the messages."""

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

from ...config import SLICE_METHODS, SliceMethod
from ...spatial.geometry import LayerHalo, TileGrid
from .. import viz
from .figure_view import display_widget
from .tile_halo_view import TileHaloView

if TYPE_CHECKING:
    import numpy as np



@dataclass(frozen=True)
class WindowedLayer:
    """A conv/pool layer as the halo geometry sees it: its input size and window."""

    name: str
    height: int
    width: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int] = (1, 1)

    def halo(self, grid: TileGrid) -> LayerHalo:
        return grid.layer_halo(self.height, self.width, self.kernel, self.stride, self.padding,
                               self.dilation, name=self.name)


def axis_values(value: object, count: int = 2) -> tuple[int, ...]:
    """A layer's kernel/stride/padding/dilation as one int per spatial axis (``count``: 2 or 3)."""
    if isinstance(value, int):
        return (value,) * count
    if isinstance(value, tuple) and len(value) == count:
        return tuple(int(item) for item in value)
    raise TypeError(f"{value!r} is neither an int nor {count} ints")


def _pair(value: object) -> tuple[int, int]:
    """A layer's kernel/stride/padding/dilation as (rows, cols)."""
    rows, cols = axis_values(value, 2)
    return (rows, cols)


@dataclass(frozen=True)
class WindowCall:
    """One call of a conv/pool layer with a window: its input's spatial sizes and its window per axis."""

    name: str
    sizes: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]


WindowModule = nn.modules.conv._ConvNd | nn.modules.pooling._MaxPoolNd | nn.modules.pooling._AvgPoolNd   # a window


def window_calls(model: nn.Module, input_shape: Sequence[int],
                 kinds: tuple[type[WindowModule], ...]) -> list[WindowCall]:
    """Every call of a ``kinds`` layer in ``model`` with a window > 1 or a stride, with its input's sizes (one
    forward pass of a ``input_shape`` (N, C, *spatial) input on the meta device); string padding is skipped."""
    model = copy.deepcopy(model).to("meta")
    count = len(input_shape) - 2
    found: list[WindowCall] = []
    handles = []

    def hook_for(name: str) -> Callable[[WindowModule, tuple[object, ...]], None]:
        def hook(module: WindowModule, inputs: tuple[object, ...]) -> None:
            x = inputs[0]
            padding = module.padding
            if not isinstance(x, torch.Tensor) or isinstance(padding, str):
                return      # 'same'/'valid' string padding: not a windowed-halo layer we draw
            kernel = axis_values(module.kernel_size, count)
            stride_value = module.stride
            stride = axis_values(stride_value if stride_value is not None else kernel, count)
            if kernel == (1,) * count and stride == (1,) * count:
                return
            found.append(WindowCall(name, tuple(int(n) for n in x.shape[-count:]), kernel, stride,
                                    axis_values(padding, count), axis_values(getattr(module, "dilation", 1), count)))
        return hook

    for name, module in model.named_modules():
        if isinstance(module, kinds):
            handles.append(module.register_forward_pre_hook(hook_for(name)))
    try:
        model(torch.empty(*input_shape, device="meta"))
    finally:
        for handle in handles:
            handle.remove()
    return found


def windowed_layers(layers: Sequence[nn.Module] | nn.Module, image_size: int | tuple[int, int],
                    in_channels: int = 3) -> list[WindowedLayer]:
    """Every Conv2d / MaxPool2d / AvgPool2d with a window > 1 or a stride, with its input size
    (found by one forward pass on the meta device)."""
    model = nn.Sequential(*layers) if not isinstance(layers, nn.Module) else layers
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    calls = window_calls(model, (1, in_channels, height, width), (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d))
    return [WindowedLayer(call.name, call.sizes[0], call.sizes[1], _pair(call.kernel), _pair(call.stride),
                          _pair(call.padding), _pair(call.dilation)) for call in calls]


def _image_side(image: np.ndarray | torch.Tensor) -> int:
    """Height of an HxW(xC) array or a CxHxW tensor."""
    is_chw = isinstance(image, torch.Tensor) and image.ndim == 3
    return int(image.shape[1] if is_chw else image.shape[0])


DEFAULT_LAYERS = (
    WindowedLayer("conv 3x3", 512, 512, (3, 3), (1, 1), (1, 1)),
    WindowedLayer("conv 7x7 stride 2", 512, 512, (7, 7), (2, 2), (3, 3)),
    WindowedLayer("conv 3x3 dilation 4", 512, 512, (3, 3), (1, 1), (4, 4), (4, 4)),
    WindowedLayer("max pool 3x3 stride 2", 512, 512, (3, 3), (2, 2), (1, 1)),
)


FIGURE_PX = 460      # the figure's side on screen: controls + figure fit a 1366x768 laptop screen
TRIM_NOTE = ("a negative halo is a trim: with a stride, a tile's own edge rows/cols that none of its outputs "
             "read are cut off locally (nothing is sent)")


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


class HaloViewer(TileHaloView):
    """Pick a layer and a tile; see the tile grid, the halo bands (corners hatched) and arrows
    of every halo message over ``image`` (HxWxC array or CHW tensor).

    ``layers``: WindowedLayer list, or a layer list of a model (``windowed_layers`` finds the
    convs/pools at ``image_size``). ``slice_method``/``num_spatial_parts`` choose the grid.
    State: ``halo`` (geometry.LayerHalo shown), ``error`` (message when the grid cannot
    carry that layer), ``view.figure``, ``info`` (messages as text).
    """

    def __init__(self, image: np.ndarray | torch.Tensor, layers: Sequence[WindowedLayer | nn.Module] | None = None,
                 *, image_size: int | None = None,
                 slice_method: SliceMethod | str = SliceMethod.SQUARE, num_spatial_parts: int = 4) -> None:
        self.image = image
        size = image_size or _image_side(image)
        if layers is None:
            self.layers = [WindowedLayer(item.name, size, size, item.kernel, item.stride, item.padding,
                                         item.dilation) for item in DEFAULT_LAYERS]
        else:
            specs = [item for item in layers if isinstance(item, WindowedLayer)]
            modules = [item for item in layers if isinstance(item, nn.Module)]
            if len(specs) < len(layers) and len(modules) < len(layers):
                raise TypeError("layers: a list of WindowedLayer specs, or a model's layer list (nn.Module)")
            self.layers = specs if specs else windowed_layers(modules, size)
        if not self.layers:
            raise ValueError("no conv/pool layer with a window found; pass WindowedLayer specs")
        names = [f"{i}: {item.name} ({item.height}x{item.width}, k{item.kernel[0]} s{item.stride[0]} "
                 f"p{item.padding[0]}{' d' + str(item.dilation[0]) if item.dilation[0] > 1 else ''})"
                 for i, item in enumerate(self.layers)]
        self.layer_choice = w.Dropdown(options=list(zip(names, range(len(names)))), value=0,
                                       description="layer", layout=w.Layout(width="460px"))
        self.slice_choice = w.Dropdown(options=SLICE_METHODS, value=str(slice_method),
                                       description="slice")
        self.parts_choice = w.BoundedIntText(value=num_spatial_parts, min=1, max=64,
                                             description="parts")
        self.messages_box = w.Checkbox(value=True, description="show messages")
        self.start_view(FIGURE_PX)
        for control in (self.layer_choice, self.tile_choice, self.messages_box):
            control.observe(lambda change: self.update(), names="value")
        for control in (self.slice_choice, self.parts_choice):
            control.observe(self._grid_changed, names="value")
        self.widget = w.VBox([w.HBox([self.layer_choice, self.tile_choice]),
                              w.HBox([self.slice_choice, self.parts_choice, self.messages_box]),
                              self.status,
                              w.HBox([self.view.widget, self.info],
                                     layout=w.Layout(flex_flow="row wrap", align_items="flex-start"))])
        self.update()

    def grid_parts(self) -> int:
        return int(self.parts_choice.value)

    def geometry(self) -> tuple[TileGrid, LayerHalo]:
        grid = TileGrid.from_slice_method(self.slice_choice.value, self.parts_choice.value)
        return grid, self.layers[self.layer_choice.value].halo(grid)

    def status_text(self, halo: LayerHalo) -> str:
        trims = any(width < 0 for th in halo for width in th.halo.values())
        return (f"{html.escape(self.layers[self.layer_choice.value].name)}: halo per side for each tile, corners "
                f"via the second (column) phase; {halo.message_count} messages" + (f"; {TRIM_NOTE}" if trims else ""))

    def draw(self) -> Figure:
        assert self.grid is not None and self.halo is not None
        return viz.draw_tiles_and_halos(self.image, self.grid, self.halo, tiles=self.selected_tiles,
                                        show_messages=self.messages_box.value)

    def describe(self) -> str:
        """Halo widths and messages of the selected tiles as text."""
        assert self.halo is not None and self.grid is not None
        tiles = self.selected_tiles or list(range(self.grid.num_tiles))
        lines = []
        for t in tiles:
            th = self.halo.tile(t)
            lines.append(f"tile {t}: owns rows {th.rows.owned} cols {th.cols.owned}; {halo_text(th.halo, th.padding)}")
            for msg in self.halo.messages(t):
                arrow = "sends" if msg.src == t else "receives"
                other = msg.dst if msg.src == t else msg.src
                lines.append(f"   {arrow} {msg.phase} box {msg.box} ({msg.elements} px) "
                             f"{'to' if msg.src == t else 'from'} tile {other}")
        return "\n".join(lines)

    def _ipython_display_(self) -> None:  # pragma: no cover - display only
        display_widget(self.widget)
