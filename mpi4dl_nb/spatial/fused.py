"""Fused halos (MPI4DL's "halo-D2"): one wide exchange for a block of windowed layers.

Inside each ``nn.Sequential`` of a spatialized model, runs of windowed layers (conv, max/avg
pool) with BatchNorm and element-wise layers between them are grouped, ``fused_layers``
windowed layers per block. A block exchanges once, as wide as the whole block reads, then
computes the intermediate layers on the extended tile, recomputing the neighbours' border
rows locally. Unlike MPI4DL, each layer's border padding is re-applied exactly where the
serial model pads (intermediate rows outside the image are padding, not computed values),
and BatchNorm statistics use only owned rows, so the result equals the unfused (and the
serial) one. The Sequential keeps its children and parameter names; only its class changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError
from .conv import SpatialConv, conv_after_exchange, conv_after_padding
from .geometry import FusedLevel, LayerHalo, plan_fused_axis
from .halo import HaloExchange
from .kernel_layer import SpatialKernelLayer
from .layer import SpatialLayer, SpatialRuntime
from .norm import SpatialBatchNorm
from .registry import ELEMENTWISE
from .tile_marks import is_tiled, mark_tiled

_NOT_POINTWISE = (nn.Flatten, nn.Linear)


class FusedPlan:
    """This tile's plan for one block at one input size: the exchange and per-layer ranges along every axis."""

    def __init__(self, block: FusedBlock, sizes: tuple[int, ...]) -> None:
        runtime, grid = block.runtime, block.runtime.grid
        planned = [plan_fused_axis(size, parts, [w[k] for w in block.windows], what=f"{block.name} ({axis})")
                   for k, (size, parts, axis) in enumerate(zip(sizes, grid.shape, grid.axis_names))]
        outs = [sum(lv[-1].out[1] - lv[-1].out[0] for lv in levels) for _, levels in planned]
        self.geometry = LayerHalo.from_axis_plans(grid, sizes, outs, [plans for plans, _ in planned], block.name)
        # per axis (depth, rows, cols or rows, cols), this tile's levels in forward order
        self.axes: list[list[FusedLevel]] = [levels[index] for (_, levels), index
                                             in zip(planned, grid.coords(runtime.tile))]
        pad_value = block.windowed[0].pad_value
        self.exchange: HaloExchange = runtime.exchange(self.geometry, pad_value)
        for level, bn in block.norm_levels:
            for lv in (levels[level] for levels in self.axes):
                if not (lv.data[0] <= lv.owned_in[0] and lv.owned_in[1] <= lv.data[1]):
                    raise ConfigError("fused_layers", f"{block.name}: BatchNorm {bn} sees only "
                                      f"part of its owned rows inside the fused block; use a "
                                      f"smaller fused_layers")

    def padding(self, level: int) -> tuple[int, ...]:
        """``F.pad``'s padding of windowed layer ``level``'s input: (before, after) per axis, last axis first
        (an image's: left, right, top, bottom)."""
        pads: list[int] = []
        for levels in reversed(self.axes):
            lv = levels[level]
            pads += [lv.data[0] - lv.needed[0], lv.needed[1] - lv.data[1]]
        return tuple(pads)

    def inside(self, level: int) -> tuple[int, ...]:
        """In-image part of windowed layer ``level``'s padded input, local coordinates: (start, stop) per
        axis, first axis first (an image's: top, bottom, left, right)."""
        found: list[int] = []
        for levels in self.axes:
            lv = levels[level]
            before = lv.data[0] - lv.needed[0]
            found += [before, before + lv.data[1] - lv.data[0]]
        return tuple(found)

    def owned(self, level: int) -> tuple[slice, ...]:
        """Owned positions along every axis inside the data held at the input of windowed layer ``level``."""
        return tuple(slice(lv.owned_in[0] - lv.data[0], lv.owned_in[1] - lv.data[0])
                     for lv in (levels[level] for levels in self.axes))


class FusedBlock:
    """Consecutive children ``start..stop-1`` of a Sequential, run with one halo exchange."""

    def __init__(self, runtime: SpatialRuntime, members: list[nn.Module], start: int,
                 name: str) -> None:
        self.runtime = runtime
        self.members = members
        self.start, self.stop = start, start + len(members)
        self.name = name
        self.windowed = [m for m in members if isinstance(m, SpatialKernelLayer)]
        self.windows = [m.windows for m in self.windowed]
        # BatchNorm layers between windowed layers: (level of the next windowed layer, name)
        self.norm_levels: list[tuple[int, str]] = []
        level = 0
        for _i, m in enumerate(members):
            if isinstance(m, SpatialKernelLayer):
                level += 1
            elif isinstance(m, SpatialBatchNorm):
                self.norm_levels.append((level, m.layer_name))
        self._plans: dict[tuple[int, ...], FusedPlan] = {}

    def plan(self, sizes: tuple[int, ...]) -> FusedPlan:
        plan = self._plans.get(sizes)
        if plan is None:
            plan = FusedPlan(self, sizes)
            self._plans[sizes] = plan
        return plan

    def run(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.plan(self.runtime.axis_sizes(self, x))
        y, level = x, 0
        for member in self.members:
            if isinstance(member, SpatialKernelLayer):
                y = _windowed(member, y, plan, level)
                level += 1
            elif isinstance(member, SpatialBatchNorm):
                y = _normalized(member, y, plan.owned(level))
            else:
                y = member(y)
        return y

    def __deepcopy__(self, memo: dict[int, object]) -> FusedBlock:
        return self


def _windowed(member: SpatialKernelLayer, y: torch.Tensor, plan: FusedPlan, level: int) -> torch.Tensor:
    """Windowed layer ``level`` of a block: the first after the block's one exchange, the others on the data held,
    padded where the serial model pads (a conv memory-lean: it saves unpadded inputs)."""
    pads = plan.padding(level)
    if isinstance(member, SpatialConv):
        return conv_after_exchange(member, y, plan.exchange) if level == 0 else conv_after_padding(member, y, pads)
    if level == 0:
        y = plan.exchange(y)
    elif any(pads):
        y = F.pad(y, pads, value=member.pad_value)
    counting = not getattr(member, "count_include_pad", False)   # the divisor counts in-image only
    return member.apply_padded(y, plan.inside(level) if counting else None)


def _normalized(bn: SpatialBatchNorm, x: torch.Tensor, owned: tuple[slice, ...]) -> torch.Tensor:
    """``bn`` on an extended tile with the statistics of its owned window, between ``bn``'s forward pre-hooks and
    forward hooks as ``bn(x)`` runs them: the engine records the running-statistic update through those hooks
    (``pipeline/bn_replay.py``), which a bare ``normalize`` call would skip."""
    for pre_hook in list(bn._forward_pre_hooks.values()):
        pre_hook(bn, (x,))
    sample, first = x, x.dim() - len(owned)
    for k, window in enumerate(owned):
        sample = sample.narrow(first + k, window.start, window.stop - window.start)
    y = bn.normalize(x, sample)
    for hook in list(bn._forward_hooks.values()):
        hook(bn, (x,), y)
    return y


class FusedSequential(nn.Sequential):
    """nn.Sequential whose fused blocks run with one halo exchange each."""

    _fused_blocks: dict[int, FusedBlock]

    @property
    def fused_blocks(self) -> Mapping[int, FusedBlock]:
        """Read-only view of the fused blocks by index of their first child."""
        return MappingProxyType(self._fused_blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        children = list(self._modules.values())
        index = 0
        while index < len(children):
            block = self._fused_blocks.get(index)
            if block is not None:
                x = _run_block(block, x)
                index = block.stop
            else:
                x = children[index](x)
                index += 1
        return x


def _run_block(block: FusedBlock, x: torch.Tensor) -> torch.Tensor:
    """A fused block on tiles (unchecked: it is exact by construction); on a replicated
    input its layers run one by one (each serially)."""
    guard = block.runtime.guard
    if not guard.active:
        return block.run(x)
    if not is_tiled(x):
        for member in block.members:
            x = member(x)
        return x
    for member in block.members:
        if isinstance(member, SpatialLayer):
            block.runtime.note_use(member, tiled=True)
    with torch._C.DisableTorchFunction():
        return mark_tiled(block.run(x))


def _fusable(module: nn.Module) -> bool:
    if getattr(module, "ceil_mode", False):   # its window depends on the input size
        return False
    if isinstance(module, (SpatialKernelLayer, SpatialBatchNorm)):
        return True
    return isinstance(module, ELEMENTWISE) and not isinstance(module, _NOT_POINTWISE)


def _blocks(children: list[nn.Module], fused_layers: int) -> list[tuple[int, int]]:
    """(start, stop) of each block: up to ``fused_layers`` windowed layers, >= 2 of them."""
    blocks, current, count, last_window = [], None, 0, -1
    for i, child in enumerate(children + [None]):
        if child is None or not _fusable(child) or \
                (isinstance(child, SpatialKernelLayer) and count == fused_layers):
            if current is not None and count >= 2:
                blocks.append((current, last_window + 1))
            current, count = None, 0
            if child is None or not _fusable(child):
                continue
        if isinstance(child, SpatialKernelLayer):
            if current is None:
                current = i
            count += 1
            last_window = i
    return blocks


def halo_messages_sent(root: nn.Module) -> int:
    """Halo messages this rank has sent so far through every exchange under ``root`` (fused blocks included)."""
    total = 0
    for module in root.modules():
        if isinstance(module, SpatialLayer):
            total += sum(exchange.messages_sent for exchange in module._exchanges.values())
        if isinstance(module, FusedSequential):
            total += sum(plan.exchange.messages_sent for block in module.fused_blocks.values()
                         for plan in block._plans.values())
    return total


def fuse_sequentials(root: nn.Module, runtime: SpatialRuntime, fused_layers: int) -> int:
    """Turn every nn.Sequential under ``root`` (a spatialized copy) into a FusedSequential.

    Returns the number of fused blocks made.
    """
    if fused_layers < 1:
        raise ConfigError("fused_layers", f"must be >= 1, got {fused_layers}")
    made = 0
    for name, module in root.named_modules():
        if type(module) is not nn.Sequential:
            continue
        children = list(module._modules.values())
        blocks = {}
        for start, stop in _blocks(children, fused_layers):
            label = f"{name or 'root'}[{start}:{stop}] (fused)"
            blocks[start] = FusedBlock(runtime, children[start:stop], start, label)
        if blocks:
            module.__class__ = FusedSequential
            object.__setattr__(module, "_fused_blocks", blocks)
            made += len(blocks)
    return made
