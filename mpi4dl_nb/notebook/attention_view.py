"""A query token's attention on token tiles: which rank's keys arrive at which ring step, and its attention map
across the tile seams over the image (pure geometry, matplotlib drawings in viz.py's manner, a timm ViT's map).

Tokens are numbered as one process numbers them: the ``prefix`` class/register tokens first, then the token grid
row by row. Ring member ``t`` holds tile ``t``'s tokens (member 0 also the prefix); ``spatial/tokens/ring_steps.py``
says whose keys it holds at each step. Drawings take an optional ``ax`` (``axes`` for one panel per step),
return the Figure, and give their artists a ``gid`` (``"query"``, ``"held:2:3"``, ``"seam:row:1"``, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..planner.attention import TokenGrid
from ..spatial.geometry import TileGrid
from ..spatial.tokens.ring_steps import RingSchedule
from .viz import _axes, as_picture

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class RingTokens:
    """A token grid cut by a tile grid: who holds which token, in which order the ring sees the keys."""

    tokens: TokenGrid
    grid: TileGrid

    def owner(self, query: int) -> int:
        """The ring member (tile) holding token ``query`` (a class/register token: member 0)."""
        self._check(query)
        if query < self.tokens.prefix:
            return 0
        row, col = divmod(query - self.tokens.prefix, self.tokens.cols)
        return int(self.owners()[row, col])

    def owners(self) -> np.ndarray:
        """The member holding each grid token, a (rows, cols) array."""
        found = np.zeros((self.tokens.rows, self.tokens.cols), dtype=int)
        for tile in range(self.grid.num_tiles):
            (r0, r1), (c0, c1) = self.grid.extent(tile, (self.tokens.rows, self.tokens.cols))
            found[r0:r1, c0:c1] = tile
        return found

    def position(self, query: int) -> tuple[int, int] | None:
        """(row, col) of a grid token in the token grid; None for a class/register token."""
        self._check(query)
        return None if query < self.tokens.prefix else divmod(query - self.tokens.prefix, self.tokens.cols)

    def member_keys(self, member: int) -> list[int]:
        """The tokens member ``member`` holds, in the order it holds them (prefix first, then its tile row by row)."""
        (r0, r1), (c0, c1) = self.grid.extent(member, (self.tokens.rows, self.tokens.cols))
        own = [self.tokens.prefix + r * self.tokens.cols + c for r in range(r0, r1) for c in range(c0, c1)]
        return [*range(self.tokens.prefix), *own] if member == 0 else own

    def ring_order(self) -> list[int]:
        """Every token in the order the ring concatenates the keys (member 0's first)."""
        return [t for member in range(self.grid.num_tiles) for t in self.member_keys(member)]

    def arrivals(self, query: int) -> list[Arrival]:
        """At each ring step, whose keys the member holding ``query`` computes with."""
        schedule = RingSchedule(self.grid.num_tiles, self.owner(query))
        return [Arrival(step.step, step.owner, len(self.member_keys(step.owner))) for step in schedule.steps]

    def grid_map(self, weights: Sequence[float] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A query's attention ``weights`` over every token (one process's order) as the (rows, cols) map of the
        grid tokens and the weights of the prefix tokens."""
        values = np.asarray(weights, dtype=float)
        if values.shape != (self.tokens.total,):
            raise ValueError(f"{values.shape[0] if values.ndim == 1 else values.shape} weights for "
                             f"{self.tokens.total} tokens ({self.tokens.prefix} class/register + "
                             f"{self.tokens.rows} x {self.tokens.cols})")
        prefix = self.tokens.prefix
        return values[prefix:].reshape(self.tokens.rows, self.tokens.cols), values[:prefix]

    def member_shares(self, weights: Sequence[float] | np.ndarray) -> list[float]:
        """The share of a query's attention that falls on each member's keys."""
        values = np.asarray(weights, dtype=float)
        return [float(values[self.member_keys(member)].sum()) for member in range(self.grid.num_tiles)]

    def _check(self, query: int) -> None:
        if not 0 <= query < self.tokens.total:
            raise ValueError(f"token {query}: the image has tokens 0 .. {self.tokens.total - 1} "
                             f"({self.tokens.prefix} class/register first)")


@dataclass(frozen=True)
class Arrival:
    """Ring step ``step``: the member computes with the keys of ``owner`` (``keys`` of them)."""

    step: int
    owner: int
    keys: int


def query_label(tiles: RingTokens, query: int) -> str:
    """How a token is named in titles: 'class token', 'register 2', 'token (3, 5)'."""
    where = tiles.position(query)
    if where is None:
        return "class token" if query == 0 else f"prefix token {query}"
    return f"token {where}"


# ------------------------------------------------------------------------------------------------------ drawings
def draw_ring_arrivals(tiles: RingTokens, query: int, axes: Sequence[Axes] | None = None) -> Figure:
    """One panel per ring step: the tile grid (in tokens), the query's tile outlined, the tile whose keys the
    query's member holds at that step filled (``held:<step>:<owner>``), the query marked (``query``)."""
    steps = tiles.arrivals(query)
    if axes is None:
        fig = Figure(figsize=(2.3 * len(steps), 2.6))
        axes = [fig.add_subplot(1, len(steps), i + 1) for i in range(len(steps))]
    else:
        fig = _axes(axes[0], (1, 1))[0]
    rows, cols = tiles.tokens.rows, tiles.tokens.cols
    member = tiles.owner(query)
    for arrival, ax in zip(steps, axes):
        for tile in range(tiles.grid.num_tiles):
            (r0, r1), (c0, c1) = tiles.grid.extent(tile, (rows, cols))
            held = tile == arrival.owner
            ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor="#DD8452" if held else "#EEEEEE",
                                   edgecolor="#4C72B0" if tile == member else "black",
                                   linewidth=2.5 if tile == member else 0.8,
                                   gid=f"held:{arrival.step}:{tile}" if held else f"tile:{arrival.step}:{tile}"))
            ax.text((c0 + c1) / 2, (r0 + r1) / 2, f"rank {tile}", ha="center", va="center", fontsize=8)
        _mark_query(ax, tiles, query, 0.5)
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(f"step {arrival.step}: keys of rank {arrival.owner}\n({arrival.keys} keys)", fontsize=8,
                     gid=f"step:{arrival.step}")
    fig.suptitle(f"{query_label(tiles, query)} on rank {member}: the ring brings every rank's keys", fontsize=9)
    return fig


def draw_query_attention(image: np.ndarray | torch.Tensor, tiles: RingTokens, weights: Sequence[float] | np.ndarray,
                         query: int, ax: Axes | None = None) -> Figure:
    """``image`` with a query's attention ``weights`` (over every token, one process's order) as a heat map on its
    token grid, the tile seams (``seam:row:<i>``, ``seam:col:<j>``), each rank's share of the attention
    (``share:<rank>``) and the query marked; the class/register tokens' share in the title."""
    picture = as_picture(image)
    height, width = picture.shape[:2]
    grid_map, prefix = tiles.grid_map(weights)
    fig, ax = _axes(ax, (5.5, 5.5))
    ax.imshow(picture, extent=(0, width, height, 0), cmap="gray" if picture.ndim == 2 else None, gid="image")
    ax.imshow(grid_map, extent=(0, width, height, 0), cmap="inferno", alpha=0.55, interpolation="nearest",
              gid="attention")
    sy, sx = height / tiles.tokens.rows, width / tiles.tokens.cols
    rows, cols = tiles.grid.row_ranges(tiles.tokens.rows), tiles.grid.col_ranges(tiles.tokens.cols)
    for i, (start, _) in enumerate(rows[1:], start=1):
        ax.axhline(start * sy, color="white", linewidth=1.5, gid=f"seam:row:{i}")
    for j, (start, _) in enumerate(cols[1:], start=1):
        ax.axvline(start * sx, color="white", linewidth=1.5, gid=f"seam:col:{j}")
    for member, share in enumerate(tiles.member_shares(weights)):
        (r0, r1), (c0, c1) = tiles.grid.extent(member, (tiles.tokens.rows, tiles.tokens.cols))
        ax.text(c0 * sx + 4, r0 * sy + 4, f"rank {member}: {share:.0%}", color="white", fontsize=8, va="top",
                gid=f"share:{member}", bbox={"facecolor": "black", "alpha": 0.5, "pad": 2})
    _mark_query(ax, tiles, query, 0.5, (sy, sx))
    others = f", class/register tokens {prefix.sum():.0%}" if prefix.size else ""
    ax.set_title(f"attention of the {query_label(tiles, query)} across the tile seams{others}", fontsize=9)
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    return fig


def _mark_query(ax: Axes, tiles: RingTokens, query: int, centre: float,
                scale: tuple[float, float] = (1.0, 1.0)) -> None:
    """A star on the query token (a class/register token: on the image's top-left corner, member 0's)."""
    where = tiles.position(query)
    row, col = (where[0] + centre, where[1] + centre) if where is not None else (0.0, 0.0)
    ax.plot([col * scale[1]], [row * scale[0]], marker="*", markersize=14, color="#4C72B0",
            markeredgecolor="white", clip_on=False, gid="query")


# ------------------------------------------------------------------------------------------------- timm's ViTs
def vit_token_grid(vit: nn.Module, image_size: tuple[int, int]) -> TokenGrid:
    """The tokens a timm ViT makes of an image of ``image_size`` (its patch embedding's grid, its prefix)."""
    patch = tuple(int(p) for p in vars(vit.get_submodule("patch_embed"))["patch_size"])
    prefix = int(getattr(vit, "num_prefix_tokens", 0))
    return TokenGrid(image_size[0] // patch[0], image_size[1] // patch[1], prefix)


def vit_attention(vit: nn.Module, image: torch.Tensor, query: int, block: int = -1) -> np.ndarray:
    """The attention weights of token ``query`` in block ``block`` of a timm ViT on ``image`` (1, C, H, W),
    averaged over the heads: softmax of its scaled query against every key (one process's order); the
    model in eval mode (no dropout), nothing changed in it."""
    import torch

    captured: list[torch.Tensor] = []
    blocks = list(vit.get_submodule("blocks").children())
    attention = blocks[block].get_submodule("attn")
    handle = attention.register_forward_pre_hook(lambda module, args: captured.append(args[0].detach()))
    try:
        with torch.no_grad():
            vit.eval()(image)
            x = captured[0][0]                                      # (N, C)
            heads = int(vars(attention)["num_heads"])
            qkv = attention.get_submodule("qkv")(x).reshape(x.shape[0], 3, heads, -1).permute(1, 2, 0, 3)
            q = attention.get_submodule("q_norm")(qkv[0])
            k = attention.get_submodule("k_norm")(qkv[1])
            scores = (q[:, query:query + 1] @ k.transpose(-2, -1)) * float(vars(attention)["scale"])
            weights: np.ndarray = scores.softmax(-1).mean(0)[0].double().numpy()
            return weights
    finally:
        handle.remove()
