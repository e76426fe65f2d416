"""Shape-only check, before any rank starts, that every conv/pool halo fits the tiles of a grid."""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn

from .conv import conv_windows
from .geometry import LayerHalo, TileGrid, Window1d
from .pool import pool_windows


def _windows(module: nn.Module) -> tuple[Window1d, Window1d] | None:
    if isinstance(module, nn.Conv2d):
        return conv_windows(module)
    if isinstance(module, (nn.MaxPool2d, nn.AvgPool2d)):
        return pool_windows(module, getattr(module, "dilation", 1))
    return None


@contextmanager
def halo_checked(module: nn.Module, grid: TileGrid,
                 label: Callable[[str], str] = str) -> Iterator[nn.Module]:
    """A ``meta`` copy of ``module`` whose convs and pools plan their halo on ``grid`` when it is
    called: ConfigError naming the layer (``label(name)``) when a tile is thinner than its reach."""
    probe = copy.deepcopy(module).to("meta")
    handles = []
    for name, sub in probe.named_modules():
        windows = _windows(sub)
        if windows is None:
            continue

        def plan(mod: nn.Module, inputs: tuple, windows: tuple[Window1d, Window1d] = windows,
                 layer: str = label(name)) -> None:
            height, width = inputs[0].shape[-2:]
            LayerHalo.for_windows(grid, int(height), int(width), windows[0], windows[1], name=layer)
        handles.append(sub.register_forward_pre_hook(plan))
    try:
        yield probe
    finally:
        for handle in handles:
            handle.remove()
