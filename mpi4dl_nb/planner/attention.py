"""Attention on token tiles as the planner counts it: each ring member's tokens, what ring attention sends and
holds in flight, its extra work (pure: no torch, no MPI).

A ViT's blocks on a tile grid hold, on each rank, the tokens of its tile (the class and register tokens on ring
member 0). Everything in a block but attention acts per token, so a rank's block allocates what the block
allocates on its own tokens; ring attention adds what travels: at ring step ``s`` member ``r`` computes its
queries against the key/value block of member ``(r - s) mod P`` while it receives the next one, so a member's
forward sends every block but its successor's once (keys and values: ``2 (N - n_{r+1}) C`` values, about
``2 (N/P) C (P-1)``), and its backward sends keys and values around again with their gradients (twice that).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..spatial.geometry import TileGrid


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


def block_at(member: int, step: int, members: int) -> int:
    """Whose key/value block member ``member`` holds at ring step ``step`` (its own at step 0)."""
    return (member - step) % members


@dataclass(frozen=True)
class RingCost:
    """One attention layer of one ring member, one sample (bytes at ``element_bytes`` per value).

    ``sent_forward``/``sent_backward``: bytes the member sends in the layer's forward and backward (keys and
    values; in backward also their gradients); ``messages_*``: how many messages; ``in_flight_forward``: the
    next key/value block received while the current one is used (the largest block: buffers are reused);
    ``in_flight_backward``: the same with the travelling key/value gradients; ``score_block``: one block of
    attention scores (heads x own queries x the largest block); ``extra_keys``: keys the member attends to
    beyond its own (what its attention computes more than on its tokens alone)."""

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


def ring_cost(tokens: Sequence[int], member: int, dim: int, heads: int, element_bytes: int) -> RingCost:
    """``RingCost`` of ``member`` in a ring whose members hold ``tokens`` (one entry per member), attention of
    width ``dim`` (heads x head size) over ``heads`` heads."""
    members = len(tokens)
    if not 0 <= member < members:
        raise ValueError(f"member {member} of a ring of {members}")
    sent_blocks = [tokens[block_at(member, step, members)] for step in range(members - 1)]
    kv = 2 * dim * element_bytes                      # one token's key and value
    largest = max(tokens)
    forward = kv * sum(sent_blocks)
    return RingCost(
        member=member, queries=tokens[member], keys=sum(tokens),
        sent_forward=forward, sent_backward=2 * forward,
        messages_forward=2 * len(sent_blocks), messages_backward=4 * len(sent_blocks),
        in_flight_forward=kv * largest if members > 1 else 0,
        in_flight_backward=2 * kv * largest if members > 1 else 0,
        score_block=heads * tokens[member] * largest * element_bytes)


def attention_flops(queries: int, keys: int, dim: int) -> float:
    """Forward multiply-adds x 2 of attention's two products (scores and weighted values)."""
    return 4.0 * queries * keys * dim


def all_gathered_bytes(tokens: Sequence[int], member: int, dim: int, element_bytes: int) -> int:
    """What ``member`` sends in a forward that all-gathers keys and values instead (its block to every other
    member): the ring's peer, which then holds all ``N`` keys and values at once."""
    return 2 * dim * element_bytes * tokens[member] * (len(tokens) - 1)
