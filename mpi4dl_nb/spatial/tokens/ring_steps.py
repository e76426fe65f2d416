"""Ring attention's schedule (pure: no torch, no MPI): whose key/value block a ring member holds at each step,
its peers, the merge order, and the bytes it sends per attention layer.

Members sit in ring order ``0 .. P-1``; member ``i`` sends to ``i+1`` and receives from ``i-1`` (mod P).
At step ``s`` member ``i`` holds the block of member ``(i - s) mod P``: its own first, then its
predecessor's, ... so it merges the blocks in the order ``i, i-1, ..., i-P+1``. Forward, the block held
at step ``s < P-1`` is sent on while the member computes with it (the next block arrives meanwhile).
Backward, the keys/values travel the same way again; the owner keeps its own block's gradient share, and the
accumulator of the others' shares starts at the member after the owner, travels one hop behind the block (posted
after the block's compute) and, after ``P - 1`` hops, arrives back at its owner.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError


@dataclass(frozen=True)
class RingStep:
    """Step ``step`` of member ``position``'s ring: the block it computes with, and what moves meanwhile."""

    step: int
    owner: int                  # ring position whose key/value block is held (and computed with)
    arriving: int | None        # owner of the block received during this step (None: last step)

    @property
    def passes_on(self) -> bool:
        """Whether the held block is sent to the next member during this step."""
        return self.arriving is not None


@dataclass(frozen=True)
class RingSchedule:
    """Member ``position`` of a ring of ``size``: its peers and its steps."""

    size: int
    position: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.position < self.size:
            raise ConfigError("ring", f"position {self.position} in a ring of {self.size} members: "
                                      "use a position 0 .. size-1 of a ring of at least one member")

    @property
    def next(self) -> int:
        """The member this one sends to."""
        return (self.position + 1) % self.size

    @property
    def prev(self) -> int:
        """The member this one receives from."""
        return (self.position - 1) % self.size

    def owner_at(self, step: int) -> int:
        """The ring position whose block this member holds at ``step``."""
        return (self.position - step) % self.size

    @property
    def merge_order(self) -> tuple[int, ...]:
        """The owners of the blocks in the order this member merges them (its own first)."""
        return tuple(self.owner_at(s) for s in range(self.size))

    @property
    def steps(self) -> tuple[RingStep, ...]:
        last = self.size - 1
        return tuple(RingStep(s, self.owner_at(s), self.owner_at(s + 1) if s < last else None)
                     for s in range(self.size))

    def gradient_owner_arriving(self, step: int) -> int:
        """Owner of the gradient accumulator received from the previous member during backward step ``step``:
        the block held at ``step + 1``; after the last step, this member's own (complete) gradient."""
        return self.owner_at(step + 1)


def checked_counts(key_counts: tuple[int, ...], size: int) -> tuple[int, ...]:
    """``key_counts`` (one positive count per ring member), or ConfigError naming what is wrong."""
    if len(key_counts) != size:
        raise ConfigError("ring.key_counts", f"{len(key_counts)} counts for a ring of {size} members: "
                                             "give one key count per member, in ring order")
    bad = [c for c in key_counts if int(c) != c or c < 1]
    if bad:
        raise ConfigError("ring.key_counts", f"{list(key_counts)}: every member holds at least one key "
                                             f"(not {bad[0]})")
    return tuple(int(c) for c in key_counts)


@dataclass(frozen=True)
class RingTraffic:
    """Bytes one ring member sends in one attention layer."""

    forward: int
    backward: int

    @property
    def total(self) -> int:
        return self.forward + self.backward


def ring_traffic(key_counts: tuple[int, ...], position: int, key_bytes: int,
                 gradient_key_bytes: int | None = None) -> RingTraffic:
    """What member ``position`` sends per layer: ``key_bytes`` is one key's bytes over batch and heads
    (``batch * heads * head_dim * itemsize``; a value is as large), ``gradient_key_bytes`` the same for the
    travelling key/value gradients (their accumulation dtype; default ``key_bytes``).

    Forward: the key/value blocks held at steps ``0 .. P-2``. Backward: the same blocks again, and the
    gradient accumulators of the blocks held at steps ``1 .. P-1`` (the own block's share stays with its owner;
    the last hop brings each accumulator home)."""
    schedule = RingSchedule(len(key_counts), position)
    counts = checked_counts(key_counts, schedule.size)
    grad_bytes = key_bytes if gradient_key_bytes is None else gradient_key_bytes
    passed = sum(counts[step.owner] for step in schedule.steps if step.passes_on)
    accumulated = sum(counts[step.owner] for step in schedule.steps[1:])
    forward = 2 * passed * key_bytes
    return RingTraffic(forward, forward + 2 * accumulated * grad_bytes)
