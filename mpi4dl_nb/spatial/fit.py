"""Shape-only check, before any rank starts, that every conv/pool halo fits the tiles of a grid (image or volume)."""
from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .conv import conv_axis_windows
from .geometry import IDENTITY, KernelAxis, LayerHalo, TileGrid
from .pool import pool_axis_windows

_WINDOWED = {nn.Conv2d: 2, nn.Conv3d: 3, nn.MaxPool2d: 2, nn.MaxPool3d: 3, nn.AvgPool2d: 2, nn.AvgPool3d: 3}


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` on the ``meta`` device, made without copying the data of its parameters and
    buffers (a deep copy first would copy every weight: 1.2 GB and seconds for a 300M-parameter model)."""
    memo: dict[int, object] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if id(tensor) not in memo:
            empty = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) \
                else empty
    return copy.deepcopy(module, memo).to("meta")


def _windows(module: nn.Module, axes: int) -> tuple[KernelAxis, ...] | None:
    """The layer's window along each of the grid's ``axes`` tiled axes; None when it has no halo to plan (not
    windowed, of the other dimension, or pointwise: a 1x1 stride-1 conv reads no neighbour, e.g. an SE gate's on
    the replicated 1x1 map of a global pool)."""
    if next((n for kind, n in _WINDOWED.items() if isinstance(module, kind)), None) != axes:
        return None
    if isinstance(module, nn.modules.conv._ConvNd):
        windows = conv_axis_windows(module)
    else:
        assert isinstance(module, (nn.MaxPool2d, nn.AvgPool2d, nn.MaxPool3d, nn.AvgPool3d))
        windows = pool_axis_windows(module, axes, getattr(module, "dilation", 1))
    return None if windows == (IDENTITY,) * axes else windows


@contextmanager
def halo_checked(module: nn.Module, grid: TileGrid,
                 label: Callable[[str], str] = str) -> Iterator[nn.Module]:
    """A ``meta`` copy of ``module`` whose convs and pools plan their halo on ``grid`` when it is
    called: ConfigError naming the layer (``label(name)``) when a tile is thinner than its reach."""
    probe = meta_copy(module)
    handles = []
    for name, sub in probe.named_modules():
        windows = _windows(sub, grid.ndim)
        if windows is None:
            continue

        def plan(mod: nn.Module, inputs: tuple, windows: tuple[KernelAxis, ...] = windows,
                 layer: str = label(name)) -> None:
            sizes = tuple(int(n) for n in inputs[0].shape[-grid.ndim:])
            LayerHalo.for_axis_windows(grid, sizes, windows, name=layer)
        handles.append(sub.register_forward_pre_hook(plan))
    try:
        yield probe
    finally:
        for handle in handles:
            handle.remove()
