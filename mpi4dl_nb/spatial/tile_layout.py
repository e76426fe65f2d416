"""Where a tile tensor keeps the image's rows and columns (TileLayout), and lengths read from its shape (TileDim).
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum


class Axis(Enum):
    """An image axis of a tile."""

    ROWS = 0
    COLS = 1


@dataclass(frozen=True)
class TileLayout:
    """The dims (counted from the end) of a tile tensor that hold the image's rows and columns.

    ``rows == cols``: both flattened into that one dim, row-major; ``merged`` is then the tile's own
    ``(rows, cols)`` lengths, which that dim holds ``rows * cols`` of.
    """

    rows: int = -2
    cols: int = -1
    merged: tuple[int, int] | None = None

    @property
    def standard(self) -> bool:
        """The rows and columns are the last two dims, as convolutions and pools expect."""
        return self == STANDARD

    @property
    def flat(self) -> bool:
        return self.merged is not None

    @property
    def offsets(self) -> tuple[int, ...]:
        """The image dims, counted from the end (one when flattened)."""
        return (self.rows,) if self.flat else (self.rows, self.cols)

    def positions(self, ndim: int) -> tuple[int, ...]:
        """The image dims of an ``ndim``-d tile, counted from the front."""
        return tuple(ndim + offset for offset in self.offsets)

    def fits(self, ndim: int) -> bool:
        """Whether an ``ndim``-d tensor has the dims this layout names."""
        return all(ndim + offset >= 0 for offset in self.offsets)

    def lengths(self, shape: Sequence[int]) -> tuple[int, int]:
        """This tile's ``(rows, cols)`` lengths, read from its ``shape``."""
        if self.merged is not None:
            return self.merged
        return (int(shape[self.rows]), int(shape[self.cols]))

    def permuted(self, order: Sequence[int]) -> TileLayout:
        """The layout after ``permute(order)`` (``order`` normalised: output dim i is input dim order[i])."""
        ndim = len(order)

        def moved(offset: int) -> int:
            return order.index(ndim + offset) - ndim

        if self.merged is not None:
            return TileLayout(moved(self.rows), moved(self.rows), self.merged)
        return _canonical(TileLayout(moved(self.rows), moved(self.cols)))

    def without(self, removed: Iterable[int], ndim: int) -> TileLayout:
        """The layout after removing the non-image dims ``removed`` (front positions) of an ``ndim``-d tile."""
        back = [position - ndim for position in removed]

        def shifted(offset: int) -> int:
            return offset + sum(1 for b in back if b > offset)

        return _canonical(TileLayout(shifted(self.rows), shifted(self.cols), self.merged))

    def describe(self) -> str:
        if self.merged is not None:
            return f"rows and columns flattened into dim {self.rows}"
        return f"rows in dim {self.rows}, columns in dim {self.cols}"


STANDARD = TileLayout()


def _canonical(layout: TileLayout) -> TileLayout:
    return STANDARD if layout == STANDARD else layout


def flattened(lengths: tuple[int, int], offset: int = -1) -> TileLayout:
    """The layout of a tile whose rows and columns (``lengths`` long here) were merged into dim ``offset``."""
    return TileLayout(offset, offset, (int(lengths[0]), int(lengths[1])))


def normalized_order(dims: Sequence[int], ndim: int) -> list[int]:
    """``permute`` dims as non-negative positions."""
    return [d + ndim if d < 0 else d for d in dims]


def transposed_order(first: int, second: int, ndim: int) -> list[int]:
    """The permutation ``transpose(first, second)`` makes."""
    order = list(range(ndim))
    a, b = normalized_order([first, second], ndim)
    order[a], order[b] = order[b], order[a]
    return order


def moved_order(source: Sequence[int], destination: Sequence[int], ndim: int) -> list[int]:
    """The permutation ``movedim(source, destination)`` makes."""
    src, dst = normalized_order(source, ndim), normalized_order(destination, ndim)
    order: list[int | None] = [None] * ndim
    for s, d in zip(src, dst):
        order[d] = s
    rest = iter(i for i in range(ndim) if i not in src)
    return [next(rest) if slot is None else slot for slot in order]


class TileDim(int):
    """A tile's row or column count read from its shape (``x.shape[-2:]``, ``x.size(2)``).

    It is the plain local length wherever it is used as a number; only the op guard reads ``axis``, to
    resolve it to the image's length where the serial model means the full size
    (``F.interpolate(x, size=skip.shape[-2:])``). Arithmetic gives plain ints, which the guard cannot
    resolve.
    """

    axis: Axis

    def __new__(cls, value: int, axis: Axis) -> TileDim:
        dim = super().__new__(cls, value)
        dim.axis = axis
        return dim

    def __getnewargs__(self) -> tuple[int, Axis]:   # type: ignore[override]
        return (int(self), self.axis)
