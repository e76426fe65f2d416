"""Token tiles: which of a vision transformer's tokens each tile holds (pure geometry, no MPI, no torch).
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ..geometry import Box, TileGrid, split_ranges


@dataclass(frozen=True)
class TokenTiles:
    """The token geometry of one tile: global token grid, its box there, the prefix tokens tile 0 holds."""

    grid: TileGrid
    token_grid: tuple[int, int]   # (rows, cols) of tokens over the whole image
    tile: int                     # this rank's tile (ring member)
    num_prefix: int               # class + register tokens of the model (on tile 0)

    @property
    def boxes(self) -> list[Box]:
        return self.grid.tile_boxes(*self.token_grid)

    @property
    def box(self) -> Box:
        return self.boxes[self.tile]

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols) of this tile's image tokens."""
        r0, r1, c0, c1 = self.box
        return (r1 - r0, c1 - c0)

    @property
    def prefix_here(self) -> int:
        """Prefix tokens this tile holds in front of its image tokens."""
        return self.num_prefix if self.tile == 0 else 0

    @property
    def key_counts(self) -> tuple[int, ...]:
        """Tokens each ring member (tile) holds, in ring order."""
        return tuple((r1 - r0) * (c1 - c0) + (self.num_prefix if t == 0 else 0)
                     for t, (r0, r1, c0, c1) in enumerate(self.boxes))

    @property
    def image_tokens(self) -> int:
        return self.token_grid[0] * self.token_grid[1]

    def token_indices(self) -> list[int]:
        """Positions of this tile's image tokens in the image's row-major token sequence."""
        r0, r1, c0, c1 = self.box
        cols = self.token_grid[1]
        return [row * cols + col for row in range(r0, r1) for col in range(c0, c1)]


def int_pair(value: object) -> tuple[int, int]:
    """A (rows, cols) pair from an int or a 2-sequence (timm's patch_size, grid_size)."""
    if isinstance(value, int):
        return (value, value)
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return (int(value[0]), int(value[1]))
    raise TypeError(f"not a size pair: {value!r}")


def _aligned(length: int, patch: int, parts: int) -> bool:
    """Whether splitting ``length`` pixels into ``parts`` tiles cuts no patch (tile edges on patch edges)."""
    if length % patch:
        return False
    pixels, tokens = split_ranges(length, parts), split_ranges(length // patch, parts)
    return all(p == (a * patch, b * patch) for p, (a, b) in zip(pixels, tokens))


def _working_lengths(length: int, patch: int, parts: int) -> tuple[int, int]:
    """Two image lengths near ``length`` (at or below, above) whose tiles cut no patch."""
    step = patch * parts   # always aligned
    return max(step, length // step * step), (length // step + 1) * step


def check_patch_grid(grid: TileGrid, image_size: tuple[int, int], patch: tuple[int, int],
                     what: str = "the model") -> tuple[int, int]:
    """The global token grid of an ``image_size`` image cut into ``patch`` patches, refused (ConfigError
    naming sizes that work) when the grid's tiles would cut a patch."""
    height, width = image_size
    problems = []
    for axis, length, size, parts in (("height", height, patch[0], grid.rows), ("width", width, patch[1], grid.cols)):
        if not _aligned(length, size, parts):
            lower, upper = _working_lengths(length, size, parts)
            problems.append(f"image {axis} {length} over {parts} tile(s) of {what}'s {size}-pixel patches "
                            f"(sizes that work: multiples of {size * parts}, e.g. {lower} or {upper})")
    if problems:
        raise ConfigError("image_size", f"{grid} would cut a patch: " + "; ".join(problems)
                          + ". Every tile must hold whole patches: choose such an image size (the model's "
                          "img_size=) or another grid")
    return (height // patch[0], width // patch[1])
