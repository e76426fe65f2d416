"""A Swin-UNETR-style network for volumes ``(N, C, D, H, W)`` (after Hatamizadeh et al. 2022): a 3-D Swin encoder
(``models/swin3d.py``) and a convolutional decoder with skips, as a layer list the engine can cut anywhere.
More: docs/segmentation.md#notes-by-module."""
from __future__ import annotations

import torch
from torch import nn

from .swin3d import Sides, SwinStage3d, fitted_window

STAGES = 2            # Swin stages (--num-layers): the volume is downsampled by 2 ** (STAGES + 1)
FEATURE = 12          # channels after the patch embedding (--num-filters; a multiple of 3: 3 heads in stage 0)
WINDOW: Sides = (4, 4, 4)
BLOCKS = 2            # Swin blocks per stage (unshifted, shifted)
IN_CHANNELS = 1
State = torch.Tensor | tuple[torch.Tensor, ...]


def _parts(state: State) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x, *skips = state if isinstance(state, tuple) else (state,)
    return x, skips


class ResidualBlock3d(nn.Module):
    """``act(norm(conv(act(norm(conv(x))))) + shortcut(x))`` with 3x3x3 convolutions, InstanceNorm3d, LeakyReLU."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv3d(cin, cout, 3, 1, 1, bias=False), nn.InstanceNorm3d(cout, affine=True),
                                  nn.LeakyReLU(0.01), nn.Conv3d(cout, cout, 3, 1, 1, bias=False),
                                  nn.InstanceNorm3d(cout, affine=True))
        self.shortcut = nn.Identity() if cin == cout else nn.Sequential(
            nn.Conv3d(cin, cout, 1, bias=False), nn.InstanceNorm3d(cout, affine=True))
        self.act = nn.LeakyReLU(0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.body(x) + self.shortcut(x))


class SwinInput(nn.Module):
    """``x -> (embed(x), enc(x))``: 2x2x2 patches to ``feature`` channels, and the full-resolution skip.

    It also says what the whole network needs of a volume (inference's ``WholeInput``): every output voxel depends
    on the whole volume (windows over the whole token grid, InstanceNorm3d), and the sides it takes."""

    def __init__(self, in_channels: int, feature: int, stages: int = STAGES, window: Sides = WINDOW) -> None:
        super().__init__()
        self.embed = nn.Conv3d(in_channels, feature, 2, 2)
        self.enc = ResidualBlock3d(in_channels, feature)
        self.stages, self.window = stages, window

    @property
    def input_multiple(self) -> int:
        return swinunetr3d_multiple(self.stages)

    def check_input_sides(self, sides: tuple[int, ...]) -> None:
        """ValueError naming, for every side the network cannot take, the nearest sides it takes."""
        check_volume_sides(sides, self.stages, self.window)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.embed(x), self.enc(x))


class SwinLevel(nn.Module):
    """``(x, *skips) -> (stage(x), *skips, enc(x))``: a Swin stage and its input's skip."""

    def __init__(self, dim: int, heads: int, window: Sides, blocks: int = BLOCKS) -> None:
        super().__init__()
        self.stage = SwinStage3d(dim, blocks, heads, window)
        self.enc = ResidualBlock3d(dim, dim)

    def forward(self, state: State) -> tuple[torch.Tensor, ...]:
        x, skips = _parts(state)
        return (self.stage(x), *skips, self.enc(x))


class SwinBottom(nn.Module):
    """``(x, *skips) -> (enc(x), *skips)``: the residual block of the deepest grid."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.enc = ResidualBlock3d(dim, dim)

    def forward(self, state: State) -> State:
        x, skips = _parts(state)
        return (self.enc(x), *skips) if skips else self.enc(x)


class SwinUp(nn.Module):
    """``(x, *skips, skip) -> (block(cat(up(x), skip)), *skips)``; a plain tensor once no skip is left."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose3d(cin, cout, 2, 2)
        self.block = ResidualBlock3d(2 * cout, cout)

    def forward(self, state: State) -> State:
        x, skips = _parts(state)
        if not skips:
            raise ValueError("SwinUp needs a skip connection: give it the (x, *skips) tuple of the level above")
        *rest, skip = skips
        y = self.block(torch.cat([self.up(x), skip], dim=1))
        return (y, *rest) if rest else y


def swinunetr3d_multiple(stages: int = STAGES) -> int:
    """Volume sides must be multiples of this (the patch embedding and one merge per stage)."""
    return 2 ** (stages + 1)


def check_windows(sides: tuple[int, ...], stages: int = STAGES, window: Sides = WINDOW) -> None:
    """ValueError unless every stage's token grid of a ``sides`` volume is cut into whole windows."""
    for stage in range(stages):
        grid = tuple(side // 2 ** (stage + 1) for side in sides)
        fitted_window((grid[0], grid[1], grid[2]), window, shifted=True)


def side_works(side: int, axis: int, stages: int = STAGES, window: Sides = WINDOW) -> bool:
    """Whether a volume side along ``axis`` is a multiple of ``2 ** (stages + 1)`` whose token grids cut into
    windows (the other axes at the smallest side, which always does)."""
    multiple = swinunetr3d_multiple(stages)
    if side < multiple or side % multiple:
        return False
    sides = [multiple] * 3
    sides[axis] = side
    try:
        check_windows((sides[0], sides[1], sides[2]), stages, window)
    except ValueError:
        return False
    return True


def nearest_sides(side: int, axis: int, stages: int = STAGES, window: Sides = WINDOW) -> tuple[int, ...]:
    """The largest side below ``side`` and the smallest above it that the network takes along ``axis``."""
    multiple = swinunetr3d_multiple(stages)
    below = next((s for s in range(side // multiple * multiple, 0, -multiple) if side_works(s, axis, stages,
                                                                                           window)), None)
    above = next(s for s in range(-(-side // multiple) * multiple, 64 * side + multiple, multiple)
                 if side_works(s, axis, stages, window))
    return (above,) if below is None else (below, above)


def check_volume_sides(sides: tuple[int, ...], stages: int = STAGES, window: Sides = WINDOW) -> None:
    """ValueError naming every side of a ``sides`` (D, H, W) volume the network cannot take and the nearest it takes
    (multiples of ``2 ** (stages + 1)`` whose token grids cut into whole windows)."""
    bad = [f"{name} {side} (nearest that work: {' or '.join(map(str, nearest_sides(side, axis, stages, window)))})"
           for axis, (name, side) in enumerate(zip(("depth", "height", "width"), sides))
           if not side_works(side, axis, stages, window)]
    if bad:
        raise ValueError(f"swinunetr3d ({stages} Swin stages, windows of {'x'.join(map(str, window))} tokens) takes "
                         f"sides that are multiples of {swinunetr3d_multiple(stages)} whose token grids cut into "
                         f"whole windows; not {', '.join(bad)}")


def swinunetr3d(stages: int = STAGES, feature: int = FEATURE, num_classes: int = 2, *,
                in_channels: int = IN_CHANNELS, window: Sides = WINDOW) -> list[nn.Module]:
    """The network as ``2 * stages + 4`` layers (``SwinInput``, ``stages`` ``SwinLevel``, ``SwinBottom``,
    ``stages + 1`` ``SwinUp``, the 1x1x1 head); its logits ``(N, classes, D, H, W)`` are as large as the volume."""
    if stages < 1 or feature < 1 or num_classes < 1 or in_channels < 1:
        raise ValueError(f"swinunetr3d needs stages, feature size, classes and input channels >= 1, got {stages}, "
                         f"{feature}, {num_classes}, {in_channels}")
    if feature % 3:
        raise ValueError(f"swinunetr3d: --num-filters {feature} (the feature size) must be a multiple of 3: stage 0 "
                         f"has 3 attention heads (use e.g. {3 * max(1, round(feature / 3))})")
    dims = [feature * 2 ** i for i in range(stages + 1)]
    layers: list[nn.Module] = [SwinInput(in_channels, feature, stages, window)]
    layers += [SwinLevel(dims[i], 3 * 2 ** i, window) for i in range(stages)]
    layers.append(SwinBottom(dims[stages]))
    layers += [SwinUp(dims[i + 1], dims[i]) for i in reversed(range(stages))]
    layers += [SwinUp(feature, feature), nn.Conv3d(feature, num_classes, 1)]
    return layers
