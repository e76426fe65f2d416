"""Training augmentation that tiles see exactly as one process would: flips, 90-degree turns, colour and HED jitter.

A sample's augmentation is drawn from a generator keyed by ``(seed, epoch, step, sample index)`` alone, so
every rank that reads a part of the image draws the same parameters, a resumed run draws what the
uninterrupted one drew, and a step's draws do not depend on the layout. A rank reads only its box of the
*augmented* image: ``Draw.source_box`` maps the box through the flips and turns back to the stored image,
the region read there is flipped and turned like the whole image would be (a box of a flipped image is the
flipped box of the image), and the colour changes act on each pixel alone (contrast about mid-grey, not the
image's mean), so a tile of the augmented image equals the augmented tile.

``color``: brightness, contrast and saturation factors in ``1 +- strength``. ``hed``: stain jitter in the
haematoxylin-eosin-DAB space of colour deconvolution (Ruifrok and Johnston's stain vectors): each stain's
concentration is scaled by ``1 + a`` and shifted by ``b``, ``a, b`` uniform in ``+- sigma`` (Tellez et al.'s
"HED-light" range, 0.05, on the optical-density scale of ``skimage.color.rgb2hed``).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import Choice
from ..errors import ConfigError
from ..spatial.geometry import Box

# optical densities of haematoxylin, eosin and DAB (rows), in R, G, B (Ruifrok and Johnston, 2001)
RGB_FROM_HED = ((0.650, 0.704, 0.286), (0.072, 0.990, 0.105), (0.268, 0.570, 0.776))
DARKEST = 1e-6                           # the least intensity colour deconvolution takes the log of
GREY = (0.299, 0.587, 0.114)             # luma weights of R, G, B (saturation blends towards this grey)
DRAWS = 12                               # uniform numbers drawn per sample, whatever is enabled


class AugmentKind(Choice):
    """One augmentation of ``--augment``."""

    FLIP = "flip"       # horizontal and vertical flips, each with probability 1/2
    ROT90 = "rot90"     # 0, 1, 2 or 3 quarter turns
    COLOR = "color"     # brightness, contrast, saturation
    HED = "hed"         # stain jitter after colour deconvolution

    @property
    def geometric(self) -> bool:
        return self in (AugmentKind.FLIP, AugmentKind.ROT90)


@dataclass(frozen=True)
class Draw:
    """One sample's augmentation: flips and turns of the image, colour factors, stain scales and shifts."""

    hflip: bool = False
    vflip: bool = False
    turns: int = 0
    brightness: float = 1.0
    contrast: float = 1.0
    saturation: float = 1.0
    stain_scale: tuple[float, float, float] = (1.0, 1.0, 1.0)
    stain_shift: tuple[float, float, float] = (0.0, 0.0, 0.0)
    recolour: bool = False
    stain: bool = False

    def source_point(self, row: int, col: int, size: int) -> tuple[int, int]:
        """The pixel of the stored ``size x size`` image that lands on ``(row, col)`` of the augmented one."""
        for _ in range(self.turns):                # torch.rot90(x, 1): out[r, c] = x[c, size - 1 - r]
            row, col = col, size - 1 - row
        if self.vflip:
            row = size - 1 - row
        if self.hflip:
            col = size - 1 - col
        return row, col

    def source_box(self, box: Box, size: int) -> Box:
        """The box of the stored image whose pixels make up ``box`` of the augmented image."""
        r0, r1, c0, c1 = box
        corners = [self.source_point(r0, c0, size), self.source_point(r1 - 1, c1 - 1, size)]
        rows, cols = [p[0] for p in corners], [p[1] for p in corners]
        return (min(rows), max(rows) + 1, min(cols), max(cols) + 1)

    def place(self, region: torch.Tensor) -> torch.Tensor:
        """A region read at ``source_box`` (..., h, w), flipped and turned as the whole image is."""
        if self.hflip:
            region = region.flip(-1)
        if self.vflip:
            region = region.flip(-2)
        if self.turns:
            region = torch.rot90(region, self.turns, dims=(-2, -1))
        return region

    def recoloured(self, region: torch.Tensor) -> torch.Tensor:
        """The colour changes of an RGB region (3, h, w) in [0, 1], pixel by pixel."""
        if not (self.recolour or self.stain):
            return region
        x = region.to(torch.float64)
        if self.stain:
            x = self._stain_jitter(x)
        if self.recolour:
            x = (x * self.brightness - 0.5) * self.contrast + 0.5
            grey = sum(w * x[c] for c, w in enumerate(GREY))
            x = (grey + (x - grey) * self.saturation).clamp(0.0, 1.0)
        return x.to(region.dtype)

    def _stain_jitter(self, x: torch.Tensor) -> torch.Tensor:
        rgb_from_hed = torch.tensor(RGB_FROM_HED, dtype=torch.float64)
        log_darkest = math.log(DARKEST)
        density = torch.log(x.clamp(min=DARKEST)) / log_darkest                  # 0 (white) .. 1 (black)
        stains = _mixed(density, torch.linalg.inv(rgb_from_hed))
        scale = torch.tensor(self.stain_scale, dtype=torch.float64)[:, None, None]
        shift = torch.tensor(self.stain_shift, dtype=torch.float64)[:, None, None]
        jittered = _mixed(stains * scale + shift, rgb_from_hed)
        return torch.exp(jittered * log_darkest).clamp(0.0, 1.0)

    def apply(self, region: torch.Tensor) -> torch.Tensor:
        """A region read at ``source_box``: placed, then recoloured."""
        return self.recoloured(self.place(region))


def _mixed(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``out[s] = sum_c x[c] * matrix[c, s]`` pixel by pixel, in one fixed order: the same bits for a pixel whatever
    the region's size (a matrix product's kernel, and so its rounding, changes with the size)."""
    return sum((x[c] * matrix[c, :, None, None] for c in range(1, x.shape[0])), x[0] * matrix[0, :, None, None])


def _uniform(u: float, strength: float) -> float:
    """``u`` in [0, 1) as a number in ``[-strength, strength)``."""
    return strength * (2.0 * u - 1.0)


@dataclass(frozen=True)
class AugmentSpec:
    """Which augmentations a run applies, and their strengths; ``draw`` gives one sample's."""

    kinds: frozenset[AugmentKind] = field(default_factory=frozenset)
    color_strength: float = 0.2
    hed_sigma: float = 0.05

    def __post_init__(self) -> None:
        object.__setattr__(self, "kinds", frozenset(AugmentKind(k) for k in self.kinds))
        for name, value in (("color_strength", self.color_strength), ("hed_sigma", self.hed_sigma)):
            if not (0.0 <= value < 1.0):
                raise ConfigError("--augment", f"{name} must lie in [0, 1), got {value:g}")

    @classmethod
    def parse(cls, text: str | None) -> AugmentSpec:
        """``--augment flip,rot90,color,hed`` (any subset, any order; ``none`` or empty: nothing)."""
        names = [part.strip().lower() for part in (text or "").split(",") if part.strip()]
        if names == ["none"]:
            names = []
        unknown = [n for n in names if n not in AugmentKind.values()]
        if unknown:
            raise ConfigError("--augment", f"unknown augmentation {', '.join(unknown)}; choose any of "
                                           f"{','.join(AugmentKind.values())} (comma-separated)")
        return cls(frozenset(AugmentKind(n) for n in names))

    def __bool__(self) -> bool:
        return bool(self.kinds)

    def check_channels(self, channels: int) -> None:
        """ConfigError when a colour augmentation is asked of images that are not RGB."""
        colour = sorted(k.value for k in self.kinds if not k.geometric)
        if colour and channels != 3:
            raise ConfigError("--augment", f"{','.join(colour)} change RGB colours, but the images have "
                                           f"{channels} channels; use flip,rot90 only")

    def draw(self, seed: int, epoch: int, step: int, index: int) -> Draw:
        """Sample ``index``'s augmentation at ``step`` of ``epoch``: a pure function of the four numbers."""
        u = np.random.default_rng([seed, epoch, step, index]).random(DRAWS).tolist()
        kinds = self.kinds
        flip, turn = AugmentKind.FLIP in kinds, AugmentKind.ROT90 in kinds
        colour, stain = AugmentKind.COLOR in kinds, AugmentKind.HED in kinds
        s, sigma = self.color_strength, self.hed_sigma
        return Draw(
            hflip=flip and u[0] < 0.5, vflip=flip and u[1] < 0.5, turns=int(u[2] * 4) if turn else 0,
            brightness=1.0 + _uniform(u[3], s) if colour else 1.0,
            contrast=1.0 + _uniform(u[4], s) if colour else 1.0,
            saturation=1.0 + _uniform(u[5], s) if colour else 1.0,
            stain_scale=(1.0 + _uniform(u[6], sigma), 1.0 + _uniform(u[7], sigma), 1.0 + _uniform(u[8], sigma))
            if stain else (1.0, 1.0, 1.0),
            stain_shift=(_uniform(u[9], sigma), _uniform(u[10], sigma), _uniform(u[11], sigma))
            if stain else (0.0, 0.0, 0.0),
            recolour=colour, stain=stain)

    def describe(self) -> str:
        """``flip,rot90,color`` in a fixed order (``none``): what the run identity and the record name."""
        return ",".join(k.value for k in AugmentKind if k in self.kinds) or "none"

    def to_dict(self) -> dict[str, object]:
        return {"kinds": [k.value for k in AugmentKind if k in self.kinds], "color_strength": self.color_strength,
                "hed_sigma": self.hed_sigma}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> AugmentSpec:
        """The spec ``to_dict`` stored; ValueError naming a bad field."""
        kinds = data.get("kinds", [])
        strength, sigma = data.get("color_strength", 0.2), data.get("hed_sigma", 0.05)
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
            raise ValueError(f"field 'kinds': expected a list of names, got {kinds!r}")
        if not isinstance(strength, (int, float)) or not isinstance(sigma, (int, float)):
            raise ValueError(f"fields 'color_strength'/'hed_sigma': expected numbers, got {strength!r}, {sigma!r}")
        return cls(frozenset(_kinds(kinds)), float(strength), float(sigma))


def _kinds(names: Iterable[str]) -> list[AugmentKind]:
    try:
        return [AugmentKind(n) for n in names]
    except ValueError as err:
        raise ValueError(f"field 'kinds': {err}") from None
