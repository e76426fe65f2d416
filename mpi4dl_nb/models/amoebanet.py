"""AmoebaNet-D (Real et al. 2019; the GPipe/MPI4DL benchmark network) as a list of splittable layers.

Cells take two states (the outputs of the two previous cells). To keep one tensor between layers
(and stages), every layer hands on ``cat([h0_next, s], dim=1)``: its own output ``s`` plus the
*next* cell's preprocessed first state ``h0_next``, computed from the layer's raw previous state
(the preprocessing module simply lives in the producing layer; the function is unchanged).
Every operation is a standard conv/pool/BN/ReLU, add or channel concat, so ``spatialize`` can tile
any layer. Deviation from TensorFlow's factorized reduction: its second path averages each 2x2
block instead of shifting the image by one pixel (a shift is not a tile-local operation).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .head import ClassifierHead

# Genotype of AmoebaNet-D (TensorFlow reference implementation, as used by GPipe):
# pairs of (input state index, operation); each consecutive pair is summed into a new state.
NORMAL_OPERATIONS: tuple[tuple[int, str], ...] = (
    (1, "conv_1x1"), (1, "max_pool_3x3"),
    (1, "none"), (0, "conv_1x7_7x1"),
    (0, "conv_1x1"), (0, "conv_1x7_7x1"),
    (2, "max_pool_3x3"), (2, "none"),
    (1, "avg_pool_3x3"), (5, "conv_1x1"),
)
NORMAL_CONCAT: tuple[int, ...] = (0, 3, 4, 6)
REDUCTION_OPERATIONS: tuple[tuple[int, str], ...] = (
    (0, "max_pool_2x2"), (0, "max_pool_3x3"),
    (2, "none"), (1, "conv_3x3"),
    (2, "conv_1x7_7x1"), (2, "max_pool_3x3"),
    (3, "none"), (1, "max_pool_2x2"),
    (2, "avg_pool_3x3"), (3, "conv_1x1"),
)
REDUCTION_CONCAT: tuple[int, ...] = (4, 5, 6)
IMAGE_MULTIPLE = 32  # stem stride 2 and four reduction cells


def relu_conv_bn(in_channels: int, out_channels: int, kernel: tuple[int, int],
                 stride: tuple[int, int], padding: tuple[int, int]) -> list[nn.Module]:
    """ReLU -> conv (no bias) -> BN, as a list of modules."""
    return [nn.ReLU(), nn.Conv2d(in_channels, out_channels, kernel, stride=stride,
                                 padding=padding, bias=False), nn.BatchNorm2d(out_channels)]


def conv_1x1(channels: int, stride: int) -> nn.Module:
    """ReLU-conv1x1-BN."""
    return nn.Sequential(*relu_conv_bn(channels, channels, (1, 1), (stride, stride), (0, 0)))


def conv_3x3(channels: int, stride: int) -> nn.Module:
    """Bottlenecked 3x3: 1x1 to channels/4, 3x3 (stride), 1x1 back; each ReLU-conv-BN."""
    mid = max(1, channels // 4)
    return nn.Sequential(*relu_conv_bn(channels, mid, (1, 1), (1, 1), (0, 0)),
                         *relu_conv_bn(mid, mid, (3, 3), (stride, stride), (1, 1)),
                         *relu_conv_bn(mid, channels, (1, 1), (1, 1), (0, 0)))


def conv_1x7_7x1(channels: int, stride: int) -> nn.Module:
    """Bottlenecked factorised 7x7: 1x1 to channels/4, 1x7, 7x1 (stride split over both), 1x1 back."""
    mid = max(1, channels // 4)
    return nn.Sequential(*relu_conv_bn(channels, mid, (1, 1), (1, 1), (0, 0)),
                         *relu_conv_bn(mid, mid, (1, 7), (1, stride), (0, 3)),
                         *relu_conv_bn(mid, mid, (7, 1), (stride, 1), (3, 0)),
                         *relu_conv_bn(mid, channels, (1, 1), (1, 1), (0, 0)))


def max_pool_3x3(channels: int, stride: int) -> nn.Module:
    """3x3 max pool, padding 1."""
    return nn.MaxPool2d(3, stride=stride, padding=1)


def max_pool_2x2(channels: int, stride: int) -> nn.Module:
    """2x2 max pool (only used with stride 2)."""
    if stride != 2:
        raise ValueError("max_pool_2x2 is only defined with stride 2 in AmoebaNet-D")
    return nn.MaxPool2d(2, stride=2)


def avg_pool_3x3(channels: int, stride: int) -> nn.Module:
    """3x3 average pool, padding 1, padding not counted (as in the reference)."""
    return nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)


def none(channels: int, stride: int) -> nn.Module:
    """Identity (only used with stride 1)."""
    if stride != 1:
        raise ValueError("'none' (identity) cannot reduce; AmoebaNet-D never uses it with stride 2")
    return nn.Identity()


OPERATIONS: dict[str, Callable[[int, int], nn.Module]] = {
    "conv_1x1": conv_1x1, "conv_3x3": conv_3x3, "conv_1x7_7x1": conv_1x7_7x1,
    "max_pool_3x3": max_pool_3x3, "max_pool_2x2": max_pool_2x2,
    "avg_pool_3x3": avg_pool_3x3, "none": none,
}


class ReduceHalf(nn.Module):
    """Half resolution and ``out_channels``: ReLU, then [1x1 stride-2 conv | 2x2 avg pool -> 1x1 conv], BN."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        half = out_channels // 2
        self.relu = nn.ReLU()
        self.sample = nn.Conv2d(in_channels, half, 1, stride=2, bias=False)
        self.pool = nn.AvgPool2d(2, stride=2)
        self.mix = nn.Conv2d(in_channels, out_channels - half, 1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(x)
        return self.bn(torch.cat([self.sample(x), self.mix(self.pool(x))], dim=1))


def preprocess_first_state(in_channels: int, out_channels: int, halve: bool) -> nn.Module:
    """The next cell's ``h0`` preprocessing: ReduceHalf after a reduction, else ReLU-conv1x1-BN."""
    if halve:
        return ReduceHalf(in_channels, out_channels)
    return nn.Sequential(*relu_conv_bn(in_channels, out_channels, (1, 1), (1, 1), (0, 0)))


@dataclass(frozen=True)
class CellPlan:
    """Channels and kind of one cell in the sequence."""

    reduction: bool
    channels: int          # C of the cell's internal states
    in_prev: int           # raw channels of the previous state s_{k-1}
    out_channels: int      # channels of this cell's output s_k


class AmoebaStem(nn.Module):
    """Stem: 3x3 stride-2 conv -> BN; hands on ``cat([h0 of cell 1, stem output])``."""

    def __init__(self, in_channels: int, channels: int, next_h0: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, channels, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.next_h0 = next_h0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.bn(self.conv(x))
        return torch.cat([self.next_h0(s), s], dim=1)


class AmoebaCell(nn.Module):
    """One normal or reduction cell; input ``cat([h0, s_prev])``, output ``cat([h0_next, s])`` or ``s`` if last."""

    def __init__(self, plan: CellPlan, next_h0: nn.Module | None) -> None:
        super().__init__()
        self.plan = plan
        c = plan.channels
        self.preprocess_prev = nn.Sequential(*relu_conv_bn(plan.in_prev, c, (1, 1), (1, 1), (0, 0)))
        operations = REDUCTION_OPERATIONS if plan.reduction else NORMAL_OPERATIONS
        self.inputs = tuple(index for index, _ in operations)
        self.concat = REDUCTION_CONCAT if plan.reduction else NORMAL_CONCAT
        self.ops = nn.ModuleList(
            OPERATIONS[name](c, 2 if plan.reduction and index < 2 else 1)
            for index, name in operations)
        self.next_h0 = next_h0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.plan.channels
        h0, s_prev = x[:, :c], x[:, c:]
        states = [h0, self.preprocess_prev(s_prev)]
        for pair in range(0, len(self.ops), 2):
            a, b = self.inputs[pair], self.inputs[pair + 1]
            states.append(self.ops[pair](states[a]) + self.ops[pair + 1](states[b]))
        s = torch.cat([states[i] for i in self.concat], dim=1)
        if self.next_h0 is None:
            return s
        return torch.cat([self.next_h0(s_prev), s], dim=1)


def cell_plans(num_layers: int, channel: int) -> list[CellPlan]:
    """The cell sequence: reductions x1, x2 (stem cells), then 3 stacks of normal cells at x4, x8, x16
    separated by reductions at x8 and x16; ``num_layers`` normal cells in all."""
    if num_layers < 3 or num_layers % 3:
        near = max(3, 3 * round(num_layers / 3))
        raise ValueError(f"num_layers={num_layers}: AmoebaNet-D needs a positive multiple of 3 "
                         f"normal cells (3 stacks); use e.g. {near} (MPI4DL default 18)")
    per_stack = num_layers // 3
    sequence = [(True, 1), (True, 2)]
    for stack, scale in enumerate((4, 8, 16)):
        if stack > 0:
            sequence.append((True, scale))
        sequence += [(False, scale)] * per_stack
    plans, prev = [], channel
    for reduction, scale in sequence:
        c = channel * scale
        concat = REDUCTION_CONCAT if reduction else NORMAL_CONCAT
        plans.append(CellPlan(reduction, c, prev, c * len(concat)))
        prev = c * len(concat)
    return plans


def amoebanet(num_layers: int = 18, num_filters: int = 416, num_classes: int = 10, *,
              in_channels: int = 3) -> list[nn.Module]:
    """AmoebaNet-D as ``[stem, cell, ..., cell, head]``; images must be a multiple of 32 px per side."""
    if num_filters < 4:
        raise ValueError(f"num_filters={num_filters}: AmoebaNet-D needs num_filters >= 4 "
                         f"(cells use num_filters/4 channels); MPI4DL's default is 416")
    channel = num_filters // 4
    plans = cell_plans(num_layers, channel)
    # h0 of cell k comes from s_{k-2}: the stem output for the first two cells
    stem_channels = channel
    raw_before = [stem_channels, stem_channels] + [p.out_channels for p in plans[:-1]]
    halves = [False] + [p.reduction for p in plans[:-1]]  # did cell k-1 halve the resolution?

    def h0_for(k: int) -> nn.Module:
        return preprocess_first_state(raw_before[k], plans[k].channels, halves[k])

    layers: list[nn.Module] = [AmoebaStem(in_channels, stem_channels, h0_for(0))]
    for k, plan in enumerate(plans):
        layers.append(AmoebaCell(plan, h0_for(k + 1) if k + 1 < len(plans) else None))
    layers.append(ClassifierHead(plans[-1].out_channels, num_classes, relu=True))
    return layers
