"""spatialize: turn an ordinary CNN module tree into one that runs on image tiles, exactly.

Leaves are converted in a copy of the tree (containers are shallow copies, parameters and
buffers are the same objects): Conv2d, MaxPool2d, AvgPool2d, BatchNorm2d and
AdaptiveAvgPool2d(1) become their spatial versions; element-wise layers stay as they are.
Custom containers keep their own ``forward`` — residual adds and element-wise ops work
tile by tile because ownership depends only on a tensor's size (see geometry.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ..comm.handles import Group
from ..comm.protocol import Comm
from ..config import ConfigError
from .base import SpatialRuntime, shallow_copy
from .geometry import Box, TileGrid
from .registry import ELEMENTWISE, SPATIAL_LAYERS


def _check_dropout(module: nn.modules.dropout._DropoutNd, name: str) -> None:
    if module.p > 0:
        raise ConfigError("model", f"layer {name!r} ({type(module).__name__}, p={module.p}) "
                          f"draws random masks per tile, which differ from the serial model; "
                          f"use p=0 or move it after the spatial stage")


def _convert(module: nn.Module, runtime: SpatialRuntime, name: str,
             extra_elementwise: tuple[type, ...]) -> nn.Module:
    kind = type(module)
    if kind in SPATIAL_LAYERS:
        converted = SPATIAL_LAYERS[kind].from_module(module, runtime, name)
        runtime.partial_parameters.extend(p for p in module.parameters(recurse=False))
        return converted
    if isinstance(module, (nn.Dropout, nn.Dropout2d)):
        _check_dropout(module, name)
        return module
    if kind in ELEMENTWISE or isinstance(module, extra_elementwise):
        return module
    children = list(module.named_children())
    if not children or any(True for _ in module.parameters(recurse=False)):
        supported = ", ".join(t.__name__ for t in SPATIAL_LAYERS)
        raise ConfigError("model", f"layer {name or '<root>'!r} ({kind.__name__}) is not supported "
                          f"by spatial parallelism; supported: {supported}, element-wise "
                          f"layers, and containers of them. If it acts on each pixel "
                          f"independently, pass elementwise=({kind.__name__},); otherwise "
                          f"put it after the spatial stage")
    new = shallow_copy(module, type(module))
    for child_name, child in children:
        full = f"{name}.{child_name}" if name else child_name
        new._modules[child_name] = _convert(child, runtime, full, extra_elementwise)
    return new


def spatialize(module: nn.Module, grid: TileGrid, ctx: Comm, group: Group | None = None, *,
               image_size: Sequence[int] | None = None, halo_d2: bool = False,
               fused_layers: int = 1, elementwise: Iterable[type] = ()) -> nn.Module:
    """A copy of ``module`` that computes on this rank's tile exactly what ``module`` computes
    on the whole image (same Parameter objects, so optimizer and state dict are shared).

    Input: this rank's tile ``(N, C, h, w)`` (``dl.scatter_tiles``); output: the owned tile
    of the output (``grid.tile_box`` of the output size), or the replicated result after a
    global average pool. ``group``: the tile ranks (``group.ranks[t]`` holds tile ``t``);
    None means the world. Only tile neighbours and ``group`` collectives communicate.
    ``image_size`` (H, W), when given, spares one small all-gather per forward.
    ``halo_d2``/``fused_layers``: one wider halo exchange per run of ``fused_layers``
    windowed layers inside each nn.Sequential (see fused.py).

    Parameter gradients of spatial layers are partial (this tile's share): sum them over
    the tile group (``reduce_tile_gradients``) or let the engine's gradient sum do it.
    Layers after a global average pool (e.g. the classifier) compute on replicated data
    and get the full gradient on every tile.
    """
    runtime = SpatialRuntime(grid, ctx, group, (image_size[0], image_size[1]) if image_size else None)
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise ConfigError("model", "spatialize a module with a forward (e.g. nn.Sequential), "
                          "not a ModuleList/ModuleDict")
    root = _convert(module, runtime, "", tuple(elementwise))
    if halo_d2:
        from .fused import fuse_sequentials

        fuse_sequentials(root, runtime, fused_layers)
    if root is module:   # an element-wise root: give it its own hooks
        root = shallow_copy(module, type(module))
    root.register_forward_pre_hook(runtime.begin_forward)
    root.register_forward_hook(runtime.end_forward)
    object.__setattr__(root, "spatial_runtime", runtime)
    return root


def runtime_of(net: nn.Module) -> SpatialRuntime:
    """The SpatialRuntime of a module returned by ``spatialize``."""
    runtime = getattr(net, "spatial_runtime", None)
    if not isinstance(runtime, SpatialRuntime):
        raise ValueError("not a spatialized module: build it with dl.spatialize(module, grid, ctx)")
    return runtime


def tile_partial_parameters(net: nn.Module) -> list[nn.Parameter]:
    """Parameters whose gradient on each tile is that tile's share (to be summed over tiles)."""
    seen: set[int] = set()
    result: list[nn.Parameter] = []
    for p in runtime_of(net).partial_parameters:
        if id(p) not in seen:
            seen.add(id(p))
            result.append(p)
    return result


def reduce_tile_gradients(net: nn.Module) -> None:
    """Sum the partial gradients of spatial layers over the tile group (one all-reduce)."""
    runtime = runtime_of(net)
    grads = [p.grad for p in tile_partial_parameters(net) if p.grad is not None]
    if not grads or len(runtime.ranks) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    runtime.ctx.all_reduce(flat, group=runtime.group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def output_boxes(grid: TileGrid, out_height: int, out_width: int) -> list[Box]:
    """Box each tile owns of a spatial stage's ``out_height x out_width`` output.

    Ownership depends only on the size (balanced split), so this is ``grid.tile_boxes``;
    it is what a non-spatial rank uses to assemble tiles and split the gradient back.
    """
    return grid.tile_boxes(out_height, out_width)
