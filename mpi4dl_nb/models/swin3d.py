"""The 3-D Swin encoder's pieces: window attention with relative position bias over D x H x W windows, the (shifted)
window block and 2x2x2 patch merging, all on channels-first volumes ``(N, C, D, H, W)``.

A block's token mixing is four steps a tile version can take apart (``spatial/windows/swin3d.py``): a cyclic roll of the
token grid by ``-shift`` (``roll``), the grid cut into windows (``partition``), attention inside each window with the
relative position bias and, after a shift, the mask keeping apart the tokens the roll brought together from the
grid's two ends (``-100`` between them, as the Swin papers do), then the windows put back (``reverse``) and the roll
undone. A window is ``min(window, side)`` tokens along each axis (one window over an axis no longer than it, and no
shift there); a longer side must be a multiple of the window (no padding).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..spatial.windows.swin3d import VOLUME_PATCH_MERGE, VOLUME_WINDOW_BLOCK

Sides = tuple[int, int, int]
MASKED = -100.0   # the attention score between tokens of different regions of a shifted window (Swin's value)


def fitted_window(grid: Sides, window: Sides, shifted: bool) -> tuple[Sides, Sides]:
    """The window and shift a block uses on a token ``grid``: the window clipped to each side, the shift half a
    window where the window is shorter than the side (0 elsewhere, and everywhere for an unshifted block);
    ValueError when a longer side is not a multiple of the window."""
    sides = tuple(min(w, g) for w, g in zip(window, grid))
    for g, w in zip(grid, sides):
        if g % w:
            raise ValueError(f"swinunetr3d: a token grid of {'x'.join(map(str, grid))} is not cut into windows of "
                             f"{'x'.join(map(str, window))}: each side must be at most the window or a multiple "
                             f"of it (choose an --image-size whose sides / 2 ** (stage + 1) are)")
    shift = tuple(w // 2 if shifted and w < g else 0 for w, g in zip(sides, grid))
    return (sides[0], sides[1], sides[2]), (shift[0], shift[1], shift[2])


def partition(tokens: torch.Tensor, window: Sides) -> torch.Tensor:
    """``(N, D, H, W, C)`` tokens cut into windows: ``(N * windows, d * h * w, C)``, windows in raster order."""
    n, depth, height, width, c = tokens.shape
    a, b, w = window
    cut = tokens.reshape(n, depth // a, a, height // b, b, width // w, w, c)
    return cut.permute(0, 1, 3, 5, 2, 4, 6, 7).reshape(-1, a * b * w, c)


def reverse(windows: torch.Tensor, window: Sides, grid: Sides) -> torch.Tensor:
    """``partition``'s inverse: ``(N * windows, d * h * w, C)`` back to ``(N, D, H, W, C)``."""
    a, b, w = window
    depth, height, width = grid
    c = windows.shape[-1]
    cut = windows.reshape(-1, depth // a, height // b, width // w, a, b, w, c)
    return cut.permute(0, 1, 4, 2, 5, 3, 6, 7).reshape(-1, depth, height, width, c)


def region_ids(grid: Sides, window: Sides, shift: Sides) -> torch.Tensor:
    """``(D, H, W)`` integers: the region of every position of the rolled grid (Swin's construction: per axis, the
    positions before the last window, the last window's part from the grid's end and its part rolled in from the
    start)."""
    ids = torch.zeros(grid, dtype=torch.long)
    for axis, (g, w, s) in enumerate(zip(grid, window, shift)):
        along = torch.zeros(g, dtype=torch.long)
        if s:
            along[g - w:g - s] = 1
            along[g - s:] = 2
        shape = [1, 1, 1]
        shape[axis] = g
        ids = ids * 3 + along.view(shape)
    return ids


def shift_mask(grid: Sides, window: Sides, shift: Sides, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(windows, n, n)``: 0 between tokens of one region of a rolled window, ``MASKED`` between regions."""
    ids = partition(region_ids(grid, window, shift)[None, ..., None], window)[..., 0]   # (windows, n)
    apart = ids[:, :, None] != ids[:, None, :]
    return torch.zeros(apart.shape, dtype=dtype).masked_fill(apart, MASKED)


def relative_index(window: Sides, table: Sides) -> torch.Tensor:
    """``(n, n)``: each pair of a ``window``'s tokens' row of a relative position bias table made for windows of
    ``table`` (their offset along every axis, shifted to be non-negative, in raster order)."""
    axes = torch.meshgrid(*(torch.arange(w) for w in window), indexing="ij")
    coords = torch.stack([a.flatten() for a in axes])                 # (3, n)
    offsets = coords[:, :, None] - coords[:, None, :]                  # (3, n, n)
    index = torch.zeros(offsets.shape[1:], dtype=torch.long)
    for offset, size in zip(offsets, table):
        index = index * (2 * size - 1) + offset + size - 1
    return index


class WindowAttention3d(nn.Module):
    """Multi-head self-attention inside windows of ``(B, n, C)`` tokens, with a learned bias per relative position
    (one table row per offset within a ``window``, per head) and an optional ``(windows, n, n)`` mask."""

    def __init__(self, dim: int, heads: int, window: Sides) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"swinunetr3d: {dim} channels do not split into {heads} attention heads")
        self.heads, self.window = heads, window
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.bias_table = nn.Parameter(torch.zeros(math.prod(2 * w - 1 for w in window), heads))
        nn.init.trunc_normal_(self.bias_table, std=0.02)

    def forward(self, windows: torch.Tensor, window: Sides, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, c = windows.shape
        q, k, v = self.qkv(windows).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q * self.scale) @ k.transpose(-2, -1)                        # (B, heads, n, n)
        index = relative_index(window, self.window).to(windows.device)
        scores = scores + self.bias_table[index.flatten()].reshape(n, n, -1).permute(2, 0, 1)
        if mask is not None:
            count = mask.shape[0]
            scores = (scores.reshape(b // count, count, self.heads, n, n) + mask[None, :, None]).reshape(
                b, self.heads, n, n)
        out = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, n, c)
        return self.proj(out)


class SwinBlock3d(nn.Module):
    """``x + attention(norm(x))`` over (shifted) windows, then ``x + mlp(norm(x))``; ``(N, C, D, H, W)`` in and out."""

    tile_family = VOLUME_WINDOW_BLOCK   # on a volume's tiles: spatial/windows/swin3d.py

    def __init__(self, dim: int, heads: int, window: Sides, shifted: bool, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.window, self.shifted = window, shifted
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention3d(dim, heads, window)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.permute(0, 2, 3, 4, 1)                 # channels last: (N, D, H, W, C)
        tokens = tokens + self.mix(self.norm1(tokens))
        tokens = tokens + self.mlp(self.norm2(tokens))
        return tokens.permute(0, 4, 1, 2, 3)

    def windowing(self, grid: Sides) -> tuple[Sides, Sides]:
        """The window and shift of this block on a token ``grid`` (``fitted_window``)."""
        return fitted_window(grid, self.window, self.shifted)

    def mix(self, tokens: torch.Tensor) -> torch.Tensor:
        """The attention part on a whole ``(N, D, H, W, C)`` grid: roll, partition, attend, reverse, roll back."""
        grid = (tokens.shape[1], tokens.shape[2], tokens.shape[3])
        window, shift = self.windowing(grid)
        rolled = torch.roll(tokens, [-s for s in shift], (1, 2, 3)) if any(shift) else tokens
        mask = shift_mask(grid, window, shift, tokens.dtype).to(tokens.device) if any(shift) else None
        attended = reverse(self.attn(partition(rolled, window), window, mask), window, grid)
        return torch.roll(attended, list(shift), (1, 2, 3)) if any(shift) else attended


class PatchMerging3d(nn.Module):
    """Halve every side: each 2x2x2 group of tokens concatenated (8C), normalised and projected to 2C channels."""

    tile_family = VOLUME_PATCH_MERGE   # on a volume's tiles: spatial/windows/swin3d.py

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8 * dim)
        self.reduction = nn.Linear(8 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.permute(0, 2, 3, 4, 1)
        groups = [tokens[:, i::2, j::2, k::2] for i in (0, 1) for j in (0, 1) for k in (0, 1)]
        return self.reduction(self.norm(torch.cat(groups, -1))).permute(0, 4, 1, 2, 3)


class SwinStage3d(nn.Module):
    """``depth`` blocks, every second one with shifted windows, then patch merging: ``(N, C, D, H, W)`` to
    ``(N, 2C, D/2, H/2, W/2)``."""

    def __init__(self, dim: int, depth: int, heads: int, window: Sides) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(SwinBlock3d(dim, heads, window, shifted=i % 2 == 1) for i in range(depth)))
        self.merge = PatchMerging3d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.merge(self.blocks(x))

