"""Whether the weight half of a split backward runs: spatial Functions then skip input gradients and exchanges."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_weight_half = [False]   # a flag, not thread-local: GPU backward runs on the autograd engine's device threads


@contextmanager
def weight_half() -> Iterator[None]:
    """Inside: a backward computes parameter gradients only (zero-bubble ``W``; ``pipeline/split_backward.py``)."""
    _weight_half[0] = True
    try:
        yield
    finally:
        _weight_half[0] = False


def input_gradient_wanted(needed: bool) -> bool:
    """Whether a Function's backward computes its input gradient (with its halo returns or sums over the
    tiles): when autograd needs it and the weight half of a split backward is not running."""
    return needed and not _weight_half[0]
