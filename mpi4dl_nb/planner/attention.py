"""Attention on token tiles as the planner counts it: each ring member's tokens, what ring attention sends and
holds in flight, its extra work (pure: no torch, no MPI).

A ViT's blocks on a tile grid hold, on each rank, the tokens of its tile (the class and register tokens on ring
member 0). Everything in a block but attention acts per token, so a rank's block allocates what the block
allocates on its own tokens; ring attention adds what travels (``spatial/tokens/ring_steps.py``: at ring step ``s``
member ``r`` computes its queries against the key/value block of member ``(r - s) mod P`` while it receives
the next one): a member's forward sends every block but its successor's once (keys and values, about
``2 (N/P) C (P-1)`` values), its backward the same again and every block's gradient accumulator (about twice).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..spatial.geometry import TileGrid
from ..spatial.tokens.ring_steps import RingSchedule, ring_traffic


@dataclass(frozen=True)
class TokenGrid:
    """The tokens of a whole image: a ``rows`` x ``cols`` grid after the patch embedding, and ``prefix``
    class/register tokens (held by ring member 0)."""

    rows: int
    cols: int
    prefix: int = 0

    @property
    def total(self) -> int:
        return self.rows * self.cols + self.prefix

    def member_tokens(self, grid: TileGrid) -> tuple[int, ...]:
        """Tokens held by each tile of ``grid`` (its part of the token grid; tile 0 also the prefix)."""
        counts = [h * w for h, w in (grid.tile_of_size(t, self.rows, self.cols) for t in range(grid.num_tiles))]
        counts[0] += self.prefix
        return tuple(counts)


@dataclass(frozen=True)
class RingCost:
    """One attention layer of one ring member, one sample (bytes).

    ``sent_forward``/``sent_backward``: bytes the member sends in the layer's forward and backward
    (``ring_steps.ring_traffic``: keys and values; in backward also their gradient accumulators);
    ``messages_*``: how many exchanges it posts (one packed key/value block per step, and one gradient
    accumulator per step in backward); ``in_flight_forward``: the packed copy of its own block and the next
    block arriving while the current one is used (the largest: buffers of every size are made per step);
    ``in_flight_backward``: the same with a travelling gradient accumulator and the one arriving;
    ``score_block``: one block of attention scores (heads x own queries x the largest block); ``extra_keys``:
    keys the member attends to beyond its own (what its attention computes more than on its tokens alone)."""

    member: int
    queries: int
    keys: int
    sent_forward: int
    sent_backward: int
    messages_forward: int
    messages_backward: int
    in_flight_forward: int
    in_flight_backward: int
    score_block: int

    @property
    def extra_keys(self) -> int:
        return self.keys - self.queries


def ring_cost(tokens: Sequence[int], member: int, dim: int, heads: int, element_bytes: int,
              gradient_bytes: int | None = None) -> RingCost:
    """``RingCost`` of ``member`` in a ring whose members hold ``tokens`` (one entry per member), attention of
    width ``dim`` (heads x head size) over ``heads`` heads, values of ``element_bytes`` (the travelling
    gradients of ``gradient_bytes``, default the same)."""
    counts = tuple(tokens)
    members = len(counts)
    if not 0 <= member < members:
        raise ValueError(f"member {member} of a ring of {members}")
    grad = element_bytes if gradient_bytes is None else gradient_bytes
    sent = ring_traffic(counts, member, dim * element_bytes, dim * grad)
    arriving = max((counts[step.arriving] for step in RingSchedule(members, member).steps
                    if step.arriving is not None), default=0)
    kv, kv_grad = 2 * dim * element_bytes, 2 * dim * grad
    ring = members > 1
    return RingCost(
        member=member, queries=counts[member], keys=sum(counts),
        sent_forward=sent.forward, sent_backward=sent.backward,
        messages_forward=members - 1, messages_backward=2 * (members - 1) if ring else 0,
        in_flight_forward=kv * (counts[member] + arriving) if ring else 0,
        in_flight_backward=(kv * (counts[member] + arriving) + 2 * kv_grad * max(counts)) if ring else 0,
        score_block=heads * counts[member] * max(counts) * element_bytes)


def attention_flops(queries: int, keys: int, dim: int) -> float:
    """Forward multiply-adds x 2 of attention's two products (scores and weighted values)."""
    return 4.0 * queries * keys * dim


def all_gathered_bytes(tokens: Sequence[int], member: int, dim: int, element_bytes: int) -> int:
    """What ``member`` sends in a forward that all-gathers keys and values instead (its block to every other
    member): the ring's peer, which then holds all ``N`` keys and values at once."""
    return 2 * dim * element_bytes * tokens[member] * (len(tokens) - 1)


def exposed_ring_seconds(steps: int, per_step: float, block: float, tail: float = 0.0) -> float:
    """Wire seconds a ring member waits for in one layer: each of ``steps`` ring steps posts its message (``per_step``
    seconds on the wire) before the step's block attention (``block`` seconds) runs, so only what the wire takes
    beyond the compute shows; ``tail``: what travels after the last block (in backward, its gradient's last hop)."""
    return steps * max(0.0, per_step - block) + tail
