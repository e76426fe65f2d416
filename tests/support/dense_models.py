"""Test models beyond plain CNNs: SE gates, U-Net (transposed conv, bilinear up-sampling, skip
concatenation; both from ``benchmarks/support/dense_models.py``), GroupNorm/InstanceNorm, custom
forwards with functional ops, a reused BatchNorm.

``spatial_models()``: name -> builder of an ``nn.Module`` for ``spatialize`` exactness.
``functional_ops()``: name -> (op applied inside a custom forward, display name the guard must
report); each is *not* exact on tiles, so spatialize must refuse it.
``layer_lists``: the engine's layer-list forms (``se_resnet_layers``, ``unet_layers``,
``norm_layers``, ``reused_bn_layers``); U-Net layers pass tuples ``(x, skip, ...)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# SE-ResNet and U-Net live with the benchmark that times them; the tests use them from there
from benchmarks.support.dense_models import (  # noqa: F401  (re-exported for the tests)
    Head,
    Sequence,
    SqueezeExcite,
    se_resnet_layers,
    unet_layers,
)


def norm_layers(seed: int = 0, c: int = 3, classes: int = 5) -> list[nn.Module]:
    """GroupNorm and InstanceNorm (running stats) stack with a classifier."""
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Conv2d(c, 6, 3, 1, 1), nn.GroupNorm(3, 6), nn.ReLU()),
            nn.Sequential(nn.Conv2d(6, 6, 3, 2, 1), nn.InstanceNorm2d(6, affine=True,
                                                                      track_running_stats=True),
                          nn.SiLU()),
            nn.Sequential(nn.Conv2d(6, 8, 3, 1, 1), nn.GroupNorm(2, 8), nn.ReLU()),
            Head(8, classes)]


class ReusedBN(nn.Module):
    """One BatchNorm applied twice per forward."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn(self.conv1(x)))
        return F.relu(self.bn(self.conv2(y)) + x)


def reused_bn_layers(seed: int = 0, c: int = 3, classes: int = 5) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Conv2d(c, 4, 3, 1, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU()),
            ReusedBN(4), ReusedBN(4), Head(4, classes)]


class FunctionalOp(nn.Module):
    """A conv child, then ``op(conv(x), x)`` in the custom forward (same shape as x)."""

    def __init__(self, op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], c: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(self.conv(x), x)


def functional_ops() -> dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], str]]:
    """Ops that are not exact on tiles: name -> (op(y, x), the name the refusal must contain)."""
    return {
        "lp_pool2d": (lambda y, x: F.lp_pool2d(y, 2, 3, 1) + x, "F.lp_pool2d"),   # F.max/avg_pool2d: exact
        "max_pool2d_indices": (lambda y, x: F.max_pool2d(y, 3, 1, 1, return_indices=True)[0] + x,
                               "F.max_pool2d"),
        "mean_h": (lambda y, x: y * y.mean(2, keepdim=True) + x, "mean"),   # over the whole image: exact
        "adaptive_avg_pool2d_2x2": (lambda y, x: y * F.adaptive_avg_pool2d(y, 2).mean((2, 3), keepdim=True) + x,
                                    "F.adaptive_avg_pool2d"),
        "flip": (lambda y, x: torch.flip(y, dims=(3,)) + x, "flip"),
        "roll": (lambda y, x: torch.roll(y, 1, dims=2) + x, "roll"),
        "pad": (lambda y, x: F.pad(y, (1, 0, 0, 0))[..., :-1] + x, "F.pad"),
        "slice": (lambda y, x: torch.cat([y[..., 1:], y[..., :1]], dim=-1) + x, "__getitem__"),
    }


class Interpolated(nn.Module):
    """F.interpolate inside a custom forward (exact: the guard computes it on tiles)."""

    def __init__(self, c: int = 3, mode: str = "bilinear", align_corners: bool | None = False,
                 scale: float = 2.0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.mode, self.align_corners, self.scale = mode, align_corners, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(self.conv(x), scale_factor=self.scale, mode=self.mode,
                             align_corners=self.align_corners)


def spatial_models(c: int = 3) -> dict[str, Callable[[], nn.Module]]:
    """Name -> builder of a model using the newer exact layers (float64 exactness on tiles)."""
    return {
        "se_block_linear": lambda: nn.Sequential(nn.Conv2d(c, 4, 3, padding=1), SqueezeExcite(4)),
        "se_block_conv": lambda: nn.Sequential(nn.Conv2d(c, 4, 3, padding=1),
                                               SqueezeExcite(4, conv=True)),
        "se_resnet": lambda: Sequence(se_resnet_layers(c=c)),
        "groupnorm": lambda: nn.Sequential(nn.Conv2d(c, 6, 3, padding=1), nn.GroupNorm(3, 6),
                                           nn.ReLU(), nn.Conv2d(6, 4, 3, 2, 1), nn.GroupNorm(1, 4)),
        "instancenorm": lambda: nn.Sequential(nn.Conv2d(c, 4, 3, padding=1),
                                              nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
                                              nn.Conv2d(4, 4, 3, padding=1), nn.InstanceNorm2d(4)),
        "convT_k2s2": lambda: nn.ConvTranspose2d(c, 4, 2, 2),
        "convT_k3s2p1op1": lambda: nn.ConvTranspose2d(c, 4, 3, 2, 1, output_padding=1),
        "convT_k4s2p1": lambda: nn.ConvTranspose2d(c, 4, 4, 2, 1, bias=False),
        "convT_k3s1p1_d2": lambda: nn.ConvTranspose2d(c, 4, 3, 1, 2, dilation=2),
        "convT_k5s3p2_g": lambda: nn.ConvTranspose2d(c, 6, 5, 3, 2, output_padding=2, groups=3),
        "upsample_nearest": lambda: nn.Sequential(nn.Conv2d(c, 4, 3, padding=1),
                                                  nn.Upsample(scale_factor=2)),
        "upsample_bilinear": lambda: nn.Sequential(nn.Conv2d(c, 4, 3, padding=1),
                                                   nn.Upsample(scale_factor=2, mode="bilinear")),
        "upsample_bilinear_ac": lambda: nn.Sequential(
            nn.Conv2d(c, 4, 3, padding=1), nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)),
        "interpolate_functional": lambda: Interpolated(c, "bilinear", True, 1.5),
        "unet": lambda: Sequence(unet_layers(c=c)),
        "unet_groupnorm": lambda: Sequence(unet_layers(c=c, norm="gn")),
    }
