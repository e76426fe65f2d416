"""SE-ResNet and a two-level U-Net as layer lists (tuples pass between layers), and ``Sequence`` to run one.

The cost-of-exactness benchmark times them; the tests check them exact on tiles (``tests/support/dense_models.py``
imports them from here: benchmarks never import from ``tests/``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SqueezeExcite(nn.Module):
    """``x * sigmoid(fc2(relu(fc1(pool(x)))))``: fc as Linear (after flatten) or 1x1 Conv2d."""

    def __init__(self, channels: int, reduction: int = 2, conv: bool = False) -> None:
        super().__init__()
        hidden = max(1, channels // reduction)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.conv = conv
        if conv:
            self.fc1, self.fc2 = nn.Conv2d(channels, hidden, 1), nn.Conv2d(hidden, channels, 1)
        else:
            self.fc1, self.fc2 = nn.Linear(channels, hidden), nn.Linear(hidden, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.pool(x)
        if not self.conv:
            s = torch.flatten(s, 1)
        gate = torch.sigmoid(self.fc2(F.silu(self.fc1(s))))
        return x * gate.view(x.shape[0], x.shape[1], 1, 1)


class SEBasicBlock(nn.Module):
    """BasicBlock with squeeze-and-excitation before the residual add (SE-ResNet)."""

    def __init__(self, cin: int, cout: int, stride: int = 1, conv_gate: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.se = SqueezeExcite(cout, 2, conv_gate)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.se(self.bn2(self.conv2(out)))
        return F.relu(out + identity)


class Head(nn.Module):
    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(x), 1))


def se_resnet_layers(seed: int = 0, c: int = 3, classes: int = 5, width: int = 1) -> list[nn.Module]:
    """Stem, three SE blocks (a Linear gate, a strided 1x1-conv gate, a Linear gate), head."""
    torch.manual_seed(seed)
    a, b = 6 * width, 8 * width
    stem = nn.Sequential(nn.Conv2d(c, a, 3, 1, 1, bias=False), nn.BatchNorm2d(a), nn.ReLU())
    return [stem, SEBasicBlock(a, a), SEBasicBlock(a, b, 2, conv_gate=True), SEBasicBlock(b, b),
            Head(b, classes)]


class DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int, norm: str = "bn") -> None:
        super().__init__()
        def norm_layer(ch: int) -> nn.Module:
            return nn.BatchNorm2d(ch) if norm == "bn" else nn.GroupNorm(2, ch)
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1, bias=False), norm_layer(cout), nn.ReLU(),
                                  nn.Conv2d(cout, cout, 3, 1, 1, bias=False), norm_layer(cout), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Down(nn.Module):
    """(x, *skips) -> (pool(conv(x)), *skips, conv(x)): pushes a skip."""

    def __init__(self, cin: int, cout: int, norm: str = "bn") -> None:
        super().__init__()
        self.conv = DoubleConv(cin, cout, norm)
        self.pool = nn.MaxPool2d(2)

    def forward(self, state: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, *skips = state if isinstance(state, tuple) else (state,)
        y = self.conv(x)
        return (self.pool(y), *skips, y)


class Up(nn.Module):
    """(x, *skips, skip) -> (conv(cat(up(x), skip)), *skips): pops a skip."""

    def __init__(self, cin: int, cskip: int, cout: int, transposed: bool, norm: str = "bn") -> None:
        super().__init__()
        if transposed:
            self.up: nn.Module = nn.ConvTranspose2d(cin, cin, 2, 2)
        else:
            self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.conv = DoubleConv(cin + cskip, cout, norm)

    def forward(self, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | torch.Tensor:
        x, *skips, skip = state
        y = self.conv(torch.cat([self.up(x), skip], dim=1))
        return (y, *skips) if skips else y


class Bottleneck(nn.Module):
    def __init__(self, c: int, norm: str = "bn") -> None:
        super().__init__()
        self.conv = DoubleConv(c, c, norm)

    def forward(self, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, *skips = state
        return (self.conv(x), *skips)


def unet_layers(seed: int = 0, c: int = 3, classes: int = 3, norm: str = "bn",
                width: int = 1) -> list[nn.Module]:
    """Two-level U-Net: transposed-conv up-sampling at the bottom, bilinear at the top."""
    torch.manual_seed(seed)
    a, b = 4 * width, 6 * width
    return [Down(c, a, norm), Down(a, b, norm), Bottleneck(b, norm), Up(b, b, b, True, norm),
            Up(b, a, a, False, norm), nn.Conv2d(a, classes, 1)]


class Sequence(nn.Module):
    """Runs a layer list (tuples pass between layers), like nn.Sequential."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
