"""Where each holder's shard of a parameter lies (ZeRO): equal flat slices, the last ones shorter or empty."""
from __future__ import annotations

from dataclasses import dataclass


def shard_bounds(numel: int, members: int, index: int) -> tuple[int, int]:
    """The flat slice ``[start, stop)`` member ``index`` of ``members`` keeps of a parameter of ``numel`` elements:
    slices of ``ceil(numel / members)`` elements in member order, the last ones shorter or empty."""
    width = -(-numel // members)
    start = min(index * width, numel)
    return start, min(start + width, numel)


@dataclass(frozen=True)
class ShardPlan:
    """A stage's parameters (``numels``, in order) each cut over ``members`` holders; this rank is ``index``.

    A flat tensor of the stage in *member order* holds member 0's slices of every parameter, then member 1's, and
    so on: member ``i``'s piece is ``counts[i]`` elements, what a reduce-scatter hands it and an all-gather takes.
    """

    numels: tuple[int, ...]
    members: int
    index: int

    def bounds(self, param: int, member: int) -> tuple[int, int]:
        return shard_bounds(self.numels[param], self.members, member)

    @property
    def counts(self) -> list[int]:
        """Elements of each member's piece (all its slices)."""
        return [sum(stop - start for start, stop in (self.bounds(p, m) for p in range(len(self.numels))))
                for m in range(self.members)]

    def mine(self) -> list[tuple[int, int]]:
        """This rank's slice of each parameter."""
        return [self.bounds(p, self.index) for p in range(len(self.numels))]

    def places(self) -> list[tuple[int, int, int]]:
        """(parameter, start, stop) of every slice of the member-order flat tensor, in its order."""
        return [(p, *self.bounds(p, m)) for m in range(self.members) for p in range(len(self.numels))]

    def piece_offsets(self) -> list[int]:
        """Where each of this rank's slices starts within its piece."""
        offsets, at = [], 0
        for start, stop in self.mine():
            offsets.append(at)
            at += stop - start
        return offsets

