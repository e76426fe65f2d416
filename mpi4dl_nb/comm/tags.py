"""Every message tag the package uses, in one table, with a check that no two ranges overlap.

All traffic shares one communicator per plane, so tags keep the kinds of message apart:

=============  ===============  ==================================================================
range          name             what
=============  ===============  ==================================================================
0 .. 4095      ``USER``         free for application code, tests and benchmarks
                                (``Context.send``'s default tag 0 lies here)
7100 .. 7107   ``HALO``         halo exchange (``spatial/halo.py``): rows / columns x forward /
                                backward x towards the previous / next tile
7108 .. 7111   ``RING``         ring attention (``spatial/tokens/ring.py``): key/value blocks
                                forward, again backward, and their travelling gradients
7120 .. 7121   ``WINDOW``       token gathers (``spatial/windows/exchange.py``): windows, rolls and
                                patch merges across tiles, forward / backward
24576 .. 32767 ``PIPELINE``     stage-to-stage payloads (``pipeline/schedules.py``): four classes
                                (activation / gradient x primary / GEMS mirror) of
                                ``PIPELINE_SPAN`` tags each, micro-batch x local-DP copy
                                modulo the span inside a class
=============  ===============  ==================================================================

Every tag is below 32768, the smallest ``MPI_TAG_UB`` the MPI standard allows. A pipeline
payload's tensors carry its tag; its header goes before them on the control plane's own
communicator (``Context.exchange_host``), where no tag is used: headers between two ranks
match in the order they are posted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MPI_MIN_TAG_UB = 32767   # every MPI library accepts tags 0 .. 32767


@dataclass(frozen=True)
class TagRange:
    """Tags ``start .. start + size - 1``, reserved for one kind of message."""

    name: str
    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size

    def tag(self, offset: int) -> int:
        """The ``offset``-th tag of the range (ValueError outside it)."""
        if not 0 <= offset < self.size:
            raise ValueError(f"tag offset {offset} outside the {self.size} tags of {self.name}")
        return self.start + offset

    def __contains__(self, tag: object) -> bool:
        return isinstance(tag, int) and self.start <= tag < self.stop


USER = TagRange("user", 0, 4096)
HALO = TagRange("halo", 7100, 8)
RING = TagRange("ring", 7108, 4)
WINDOW = TagRange("window", 7120, 2)
PIPELINE_SPAN = 2048
PIPELINE = TagRange("pipeline", 24576, 4 * PIPELINE_SPAN)
RANGES: tuple[TagRange, ...] = (USER, HALO, RING, WINDOW, PIPELINE)


def check_ranges(ranges: Sequence[TagRange]) -> None:
    """ValueError if two ranges overlap or a range leaves ``0 .. MPI_MIN_TAG_UB``."""
    ordered = sorted(ranges, key=lambda r: r.start)
    for r in ordered:
        if r.size < 1 or r.start < 0 or r.stop - 1 > MPI_MIN_TAG_UB:
            raise ValueError(f"tag range {r.name} [{r.start}, {r.stop}) must be non-empty and "
                             f"inside [0, {MPI_MIN_TAG_UB}]")
    for first, second in zip(ordered, ordered[1:]):
        if second.start < first.stop:
            raise ValueError(f"tag ranges {first.name} [{first.start}, {first.stop}) and "
                             f"{second.name} [{second.start}, {second.stop}) overlap")


check_ranges(RANGES)
