"""What a spatial forward received from other ranks, logged so that recomputing it needs no communication.

Activation recomputation (pipeline/recompute.py) runs a segment's forward twice: once without a
graph, once in backward. The second run gets the same inputs, so every halo strip and every
BatchNorm statistic it would receive is what the first run received. While a ``ForwardLog``
records, halo exchanges and tile BatchNorms append what they received (in call order); while
it replays, they take it back in the same order and send nothing. The logged tensors (a halo's
strips, a few floats per BatchNorm channel) are held from the first forward to the backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

Strips = list[torch.Tensor | None]              # a halo exchange's received strips (None: no neighbour)
Statistics = tuple[torch.Tensor, torch.Tensor]   # a tile BatchNorm's received (mean, var)

_ACTIVE: list[ForwardLog] = []


class ForwardLog:
    """Received halo strips and BatchNorm statistics of one forward, in call order."""

    def __init__(self) -> None:
        self.entries: list[Strips | Statistics] = []
        self._replay: Iterator[Strips | Statistics] | None = None

    @property
    def replaying(self) -> bool:
        return self._replay is not None

    def record(self, entry: Strips | Statistics) -> None:
        self.entries.append(entry)

    def next(self) -> Strips | Statistics:
        """The next recorded entry (replaying only)."""
        assert self._replay is not None
        return next(self._replay)

    def next_strips(self) -> Strips:
        """The next entry, a halo exchange's strips (replaying only)."""
        entry = self.next()
        if not isinstance(entry, list):
            raise RuntimeError("replayed forward asked for halo strips where BatchNorm statistics were logged")
        return entry

    def next_statistics(self) -> Statistics:
        """The next entry, a BatchNorm's (mean, var) (replaying only)."""
        entry = self.next()
        if not isinstance(entry, tuple):
            raise RuntimeError("replayed forward asked for BatchNorm statistics where halo strips were logged")
        return entry

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Inside, halo exchanges and tile BatchNorms append what they receive."""
        _ACTIVE.append(self)
        try:
            yield
        finally:
            _ACTIVE.remove(self)

    @contextmanager
    def replaying_entries(self) -> Iterator[None]:
        """Inside, halo exchanges and tile BatchNorms take the recorded entries in order."""
        self._replay = iter(self.entries)
        _ACTIVE.append(self)
        try:
            yield
        finally:
            _ACTIVE.remove(self)
            self._replay = None


def active_log() -> ForwardLog | None:
    """The innermost recording or replaying log (None: communicate as usual)."""
    return _ACTIVE[-1] if _ACTIVE else None
