"""Seeded random CNNs from the supported layer set, and random engine configurations.

``random_model(seed, grid)`` builds a small float64 model (convs with kernels 1-7 incl. 1xk/kx1,
strides 1-2, dilation 1-3, groups, padding; max/avg pools with count_include_pad, ceil_mode
and divisor_override; BatchNorm/GroupNorm/InstanceNorm; residual blocks; SE gates; nearest
and bilinear up-sampling and transposed convs; channel concatenation; exact custom channel
ops; sometimes a custom op that is not exact on tiles) and an input size for it. A case is
*exact* (spatialize equals serial to 1e-10) or *refused* (ConfigError); anything else is a
failure, reported with the seed and a replay command.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.support.dense_models import SqueezeExcite
from tests.support.exactness import check_spatial_exact

RTOL = 1e-10


def case_seeds(rows: int, cols: int, count: int, seed: int | None = None) -> list[int]:
    """The seeds of a launch's cases: ``seed`` alone (replay), else a fixed series per grid."""
    if seed is not None:
        return [seed + i for i in range(max(count, 1))]
    base = 100_000 + 1000 * (10 * rows + cols)
    return [base + i for i in range(count)]


def fuzz_case_names(rows: int, cols: int, count: int, seed: int | None = None) -> list[str]:
    if count == 0 and seed is None:
        return []
    return [f"fuzz {rows}x{cols} seed {s}" for s in case_seeds(rows, cols, count, seed)]


# ------------------------------------------------------------------ building blocks
class Residual(nn.Module):
    def __init__(self, body: nn.Module, down: nn.Module | None) -> None:
        super().__init__()
        self.body, self.down = body, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + (x if self.down is None else self.down(x)))


class Concat(nn.Module):
    """Skip concatenation along channels: ``cat([branch(x), x], 1)``."""

    def __init__(self, branch: nn.Module) -> None:
        super().__init__()
        self.branch = branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch(x), x], dim=1)


class ChannelOps(nn.Module):
    """Exact custom ops: channel softmax/mean/max, scaling, a per-channel parameter, slicing channels."""

    def __init__(self, channels: int, variant: int) -> None:
        super().__init__()
        self.variant = variant
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, channels).view(1, channels, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.variant == 0:
            return x * torch.softmax(x, dim=1) + 0.5 * x
        if self.variant == 1:
            att = torch.sigmoid(x.mean(dim=1, keepdim=True) + x.amax(dim=1, keepdim=True))
            return x * att
        if self.variant == 2:
            return x * self.scale + x[:, :1]
        return torch.cat([x[:, 1:], x[:, :1]], dim=1) - x.unsqueeze(1).flatten(1, 2)


class NotExact(nn.Module):
    """A custom forward using an op that is not exact on tiles (must be refused)."""

    OPS: list[Callable[[torch.Tensor], torch.Tensor]] = [
        lambda y: F.lp_pool2d(y, 2, 3, 1)[..., :1, :1] * 0 + y,   # F.max_pool2d in a forward is exact
        lambda y: y - y.mean(3, keepdim=True),     # over one image axis (the whole image is exact)
        lambda y: torch.roll(y, 1, dims=3),
        lambda y: F.pad(y, (0, 0, 1, 0))[..., :-1, :],
        lambda y: y.flip(-2),
    ]

    def __init__(self, variant: int) -> None:
        super().__init__()
        self.variant = variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.OPS[self.variant % len(self.OPS)](x) + x


@dataclass
class Shape:
    channels: int
    height: int
    width: int


def _window_out(size: int, kernel: int, stride: int, dilation: int, pad: int, ceil: bool = False) -> int:
    span = dilation * (kernel - 1) + 1
    if ceil:
        out = -(-(size + 2 * pad - span) // stride) + 1
        if (out - 1) * stride >= size + pad:
            out -= 1
        return out
    return (size + 2 * pad - span) // stride + 1


class _Builder:
    """Draws layers while tracking the feature-map shape."""

    def __init__(self, rng: random.Random, shape: Shape, grid: TileGrid) -> None:
        self.rng = rng
        self.shape = shape
        self.grid = grid

    def room(self) -> int:
        """How small the map may get (a little below the tile count, so refusals happen too)."""
        return max(2, max(self.grid.rows, self.grid.cols))

    def conv(self, cout: int | None = None, allow_stride: bool = True) -> nn.Module:
        r, s = self.rng, self.shape
        cout = cout or r.choice([2, 3, 4, 6])
        shape_kind = r.random()
        if shape_kind < 0.2:
            k = (1, r.choice([3, 5, 7])) if r.random() < 0.5 else (r.choice([3, 5, 7]), 1)
        else:
            k1 = r.choice([1, 1, 2, 3, 3, 3, 4, 5, 7])
            k = (k1, k1)
        stride = r.choice([1, 1, 2]) if allow_stride and min(s.height, s.width) >= 3 * self.room() else 1
        dilation = r.choice([1, 1, 2, 3]) if max(k) > 1 else 1
        pads = tuple(dilation * (ki - 1) // 2 + r.choice([0, 0, 1]) * (ki > 1) for ki in k)
        if r.random() < 0.2:
            pads = (0, 0)
        groups = r.choice([g for g in (1, 2, 3) if s.channels % g == 0 and cout % g == 0])
        padding: object = pads
        if stride == 1 and r.random() < 0.15:
            padding = "same"
        layer = nn.Conv2d(s.channels, cout, k, stride, padding, dilation, groups, bias=r.random() < 0.5)
        if padding == "same":
            h, w = s.height, s.width
        else:
            h = _window_out(s.height, k[0], stride, dilation, pads[0])
            w = _window_out(s.width, k[1], stride, dilation, pads[1])
        self.shape = Shape(cout, h, w)
        return layer

    def pool(self) -> nn.Module:
        r, s = self.rng, self.shape
        k = r.choice([2, 3])
        stride = r.choice([1, 2]) if min(s.height, s.width) >= 3 * self.room() else 1
        pad = r.choice([0, 1]) if k == 3 else 0
        ceil = r.random() < 0.2
        if r.random() < 0.5:
            dilation = r.choice([1, 1, 2])
            layer: nn.Module = nn.MaxPool2d(k, stride, pad, dilation, ceil_mode=ceil)
        else:
            dilation = 1
            layer = nn.AvgPool2d(k, stride, pad, ceil_mode=ceil, count_include_pad=r.random() < 0.5,
                                 divisor_override=r.choice([None, None, 3]))
        self.shape = Shape(s.channels, _window_out(s.height, k, stride, dilation, pad, ceil),
                           _window_out(s.width, k, stride, dilation, pad, ceil))
        return layer

    def norm(self) -> nn.Module:
        r, c = self.rng, self.shape.channels
        choice = r.random()
        if choice < 0.5:
            return nn.BatchNorm2d(c, momentum=r.choice([0.1, None]))
        if choice < 0.8:
            return nn.GroupNorm(r.choice([g for g in (1, 2, c) if c % g == 0]), c)
        return nn.InstanceNorm2d(c, affine=r.random() < 0.5, track_running_stats=r.random() < 0.5)

    def activation(self) -> nn.Module:
        return self.rng.choice([nn.ReLU(), nn.GELU(), nn.SiLU(), nn.LeakyReLU(0.1), nn.Tanh(),
                                nn.Identity(), nn.Dropout(0.0)])

    def up(self) -> nn.Module:
        r, s = self.rng, self.shape
        if r.random() < 0.5:
            mode = r.choice(["nearest", "bilinear", "bilinear"])
            corners = r.choice([True, False]) if mode == "bilinear" else None
            self.shape = Shape(s.channels, 2 * s.height, 2 * s.width)
            return nn.Upsample(scale_factor=2, mode=mode, align_corners=corners)
        k, stride = r.choice([(2, 2), (3, 2), (4, 2), (3, 1)])
        pad = r.choice([0, 1]) if k > 2 else 0
        op = r.choice([0, 1]) if stride > 1 else 0
        cout = r.choice([2, 4])
        h = (s.height - 1) * stride - 2 * pad + k + op
        w = (s.width - 1) * stride - 2 * pad + k + op
        self.shape = Shape(cout, h, w)
        return nn.ConvTranspose2d(s.channels, cout, k, stride, pad, op, bias=r.random() < 0.5)

    def block(self) -> nn.Module:
        r = self.rng
        roll = r.random()
        s = self.shape
        small = min(s.height, s.width)
        if roll < 0.3:
            return nn.Sequential(self.conv(), self.norm(), self.activation())
        if roll < 0.42:
            return self.pool()
        if roll < 0.55:
            cin, mid = s.channels, r.choice([2, 4])
            body = nn.Sequential(self.same_conv(cin, mid), self.norm(), nn.ReLU(), self.same_conv(mid, cin))
            return Residual(body, None)
        if roll < 0.65:
            c = max(2, s.channels)
            return nn.Sequential(self.same_conv(s.channels, c), SqueezeExcite(c, 2, r.random() < 0.5))
        if roll < 0.75 and small <= 24:
            return self.up()
        if roll < 0.85:
            cin = s.channels
            branch = nn.Sequential(self.same_conv(cin, r.choice([2, 3])), nn.ReLU())
            self.shape = Shape(self.shape.channels + cin, s.height, s.width)
            return Concat(branch)
        if roll < 0.95:
            return ChannelOps(s.channels, r.randrange(4)) if s.channels > 1 else nn.ReLU()
        return NotExact(r.randrange(10))

    def same_conv(self, cin: int, cout: int) -> nn.Module:
        """A size-preserving conv (odd kernel, symmetric padding, maybe dilated) cin -> cout."""
        k = self.rng.choice([1, 3, 5])
        d = self.rng.choice([1, 2]) if k > 1 else 1
        self.shape = Shape(cout, self.shape.height, self.shape.width)
        return nn.Conv2d(cin, cout, k, 1, d * (k - 1) // 2, d)


def random_model(seed: int, grid: TileGrid) -> tuple[nn.Module, tuple[int, int, int, int]]:
    """A random model and input shape ``(N, C, H, W)`` for ``seed`` (valid serially)."""
    for attempt in range(50):
        rng = random.Random(seed * 101 + attempt)
        torch.manual_seed(seed * 101 + attempt)
        height = rng.randint(4 * grid.rows, 12 * grid.rows + 6)
        width = rng.randint(4 * grid.cols, 12 * grid.cols + 6)
        channels = rng.choice([1, 2, 3])
        builder = _Builder(rng, Shape(channels, height, width), grid)
        blocks = []
        for _ in range(rng.randint(2, 5)):
            blocks.append(builder.block())
            if min(builder.shape.height, builder.shape.width) < 1:
                break
        if min(builder.shape.height, builder.shape.width) < 1:
            continue
        model = nn.Sequential(*blocks).double()
        shape = (rng.choice([1, 2]), channels, height, width)
        try:
            with torch.no_grad():
                model(torch.ones(shape, dtype=torch.float64))
        except (RuntimeError, ValueError):
            continue
        return model, shape
    raise RuntimeError(f"seed {seed}: no valid model in 50 attempts")


def run_fuzz_case(ctx: object, grid: TileGrid, seed: int, replay: str = "") -> str:
    """Exact or refused: returns what happened; raises AssertionError (seed, replay) otherwise."""
    model, shape = random_model(seed, grid)
    for m in model.modules():   # fresh BatchNorm statistics after the validity probe
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            m.reset_running_stats()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    try:
        errors = check_spatial_exact(model, grid, x, ctx, rtol=RTOL, what=f"fuzz seed {seed}",
                                     grad_floor=0.1)
    except ConfigError as error:
        return f"refused ({error.knob}): {str(error)[:80]}"
    except Exception as error:
        raise AssertionError(f"fuzz seed {seed} on {grid}: {type(error).__name__}: {error}\n"
                             f"model: {model}\nreplay: {replay}") from error
    return f"exact {shape}, worst rel err {max(errors.values()):.1e}"
