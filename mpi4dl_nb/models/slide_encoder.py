"""A transformer over a slide's feature grid before the head's pool (``--slide-encoder transformer``): every cell a
token, a learned class token, 2-D sine-cosine positions of the whole grid.

The encoder takes the trunk's map (N, C, H, W) and returns the class token's output (N, C) and the cells' outputs as a
map (N, C, H, W) again, so every head pool (``--pool``) reads them as it reads a trunk's cells; the classifier reads the
class token beside the pooled cells (``ClassifierHead``). Each layer is a pre-norm block (LayerNorm, multi-head
self-attention over all tokens by torch's fused kernel, LayerNorm, a GELU MLP of twice the width), a LayerNorm after
the last. Positions are fixed (no parameters), computed from each cell's row and column in the whole grid, so a canvas
of any size has them. It runs where the head runs, on the whole grid: on a layer rank (``train`` keeps a classifier's
head there: ``--split-size`` above ``--spatial-size``), after slide-level inference gathered the cells, or on one
process; on tiles (``dl.spatialize`` of the whole model) the op guard refuses it, naming this module.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Choice
from ..errors import ConfigError

DEFAULT_LAYERS = 2
DEFAULT_HEADS = 4
MLP_RATIO = 2
POSITION_BASE = 10000.0      # the wavelengths of the sine-cosine positions grow geometrically up to this


class SlideEncoderKind(Choice):
    """What runs over the slide's token grid between the trunk and the head's pool (``--slide-encoder``)."""

    TRANSFORMER = "transformer"


@dataclass(frozen=True)
class SlideEncoderSpec:
    """A slide encoder's shape: ``layers`` transformer blocks of ``heads`` attention heads (recorded in checkpoints
    as ``ModelSpec.slide_encoder``)."""

    layers: int = DEFAULT_LAYERS
    heads: int = DEFAULT_HEADS
    kind: SlideEncoderKind = SlideEncoderKind.TRANSFORMER

    def to_dict(self) -> dict[str, object]:
        return {"kind": str(self.kind), "layers": self.layers, "heads": self.heads}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> SlideEncoderSpec:
        """The spec ``to_dict`` wrote; ValueError naming a mistyped field."""
        layers, heads, kind = data.get("layers"), data.get("heads"), data.get("kind")
        if not (isinstance(layers, int) and isinstance(heads, int) and isinstance(kind, str)):
            raise ValueError(f"field 'slide_encoder': expected kind, layers and heads, got {dict(data)!r}")
        return cls(layers, heads, SlideEncoderKind(kind))

    def describe(self) -> str:
        return f"{self.kind} slide encoder ({self.layers} layers, {self.heads} heads)"

    def check_width(self, channels: int) -> None:
        """ConfigError (``--slide-encoder-heads``) unless ``channels`` tokens split into the heads and into the four
        quarters of the 2-D positions (sine and cosine of rows and columns)."""
        if channels % self.heads == 0 and channels % 4 == 0:
            return
        fits = [h for h in range(1, channels + 1) if channels % h == 0]
        if channels % 4:
            raise ConfigError("--slide-encoder", f"the trunk gives {channels} channels per token; the 2-D positions "
                                                 f"need a multiple of 4: choose a trunk width (--num-filters) whose "
                                                 f"output channels are a multiple of 4")
        raise ConfigError("--slide-encoder-heads", f"{self.heads} heads do not divide the trunk's {channels} "
                                                   f"channels per token; use one of {', '.join(map(str, fits))}")


def grid_positions(channels: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(rows * cols, channels): each cell's 2-D sine-cosine position in row-major order, from its row and column in
    the whole grid; the first half of the channels encodes the row, the second the column."""
    quarter = channels // 4
    frequencies = POSITION_BASE ** (-torch.arange(quarter, dtype=torch.float64) / max(quarter, 1))

    def axis(count: int) -> torch.Tensor:
        angles = torch.arange(count, dtype=torch.float64)[:, None] * frequencies[None]
        return torch.cat([angles.sin(), angles.cos()], 1)            # (count, channels / 2)

    row, col = axis(rows), axis(cols)
    table = torch.cat([row[:, None].expand(rows, cols, -1), col[None].expand(rows, cols, -1)], 2)
    return table.reshape(rows * cols, channels).to(device=device, dtype=dtype)


class ClassAttention(nn.Identity):
    """The class token's attention over every token (N, heads, tokens), passed through unchanged: a forward hook on
    it sees what slide-level inference draws (``infer/whole_slide.py``)."""


class SelfAttention(nn.Module):
    """Multi-head self-attention over all tokens of each sample (N, L, C) -> (N, L, C), by torch's fused kernel
    (``F.scaled_dot_product_attention``: on CPU blockwise, no L x L matrix kept for backward); the class token's
    attention row, computed beside it without a gradient, goes through the ``class_attention`` probe."""

    def __init__(self, channels: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(channels, 3 * channels)
        self.proj = nn.Linear(channels, channels)
        self.class_attention = ClassAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, channels = x.shape
        q, k, v = self.qkv(x).view(n, length, 3, self.heads, channels // self.heads).permute(2, 0, 3, 1, 4)
        with torch.no_grad():
            row = q[:, :, :1] @ k.transpose(-2, -1) / math.sqrt(channels // self.heads)
            self.class_attention(torch.softmax(row, -1)[:, :, 0])
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(n, length, channels))


class EncoderBlock(nn.Module):
    """A pre-norm transformer block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, channels: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(channels)
        self.attention = SelfAttention(channels, heads)
        self.norm2 = nn.LayerNorm(channels)
        self.mlp = nn.Sequential(nn.Linear(channels, MLP_RATIO * channels), nn.GELU(),
                                 nn.Linear(MLP_RATIO * channels, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SlideEncoder(nn.Module):
    """(N, C, H, W) -> (class token (N, C), cells (N, C, H, W)): the class token and the cells, each with its
    position, through ``spec.layers`` blocks and a final LayerNorm."""

    def __init__(self, channels: int, spec: SlideEncoderSpec) -> None:
        super().__init__()
        spec.check_width(channels)
        self.spec = spec
        self.class_token = nn.Parameter(torch.randn(1, 1, channels) * 0.02)
        self.blocks = nn.ModuleList(EncoderBlock(channels, spec.heads) for _ in range(spec.layers))
        self.norm = nn.LayerNorm(channels)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, channels, rows, cols = x.shape
        cells = x.flatten(2).transpose(1, 2) + grid_positions(channels, rows, cols, x.dtype, x.device)
        tokens = torch.cat([self.class_token.expand(n, -1, -1), cells], 1)
        for block in self.blocks:
            tokens = block(tokens)
        tokens = self.norm(tokens)
        return tokens[:, 0], tokens[:, 1:].transpose(1, 2).reshape(n, channels, rows, cols)

    def last_class_attention(self) -> ClassAttention:
        """The probe of the last block's class-token attention (a forward hook on it sees (N, heads, 1 + H * W))."""
        block = self.blocks[-1]
        assert isinstance(block, EncoderBlock)
        return block.attention.class_attention
