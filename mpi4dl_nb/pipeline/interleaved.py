"""Megatron's interleaved 1F1B order of one pipeline position over its virtual stages (pure)."""

from __future__ import annotations

from typing import NamedTuple


class ChunkOp(NamedTuple):
    """One compute op of a position: forward (else backward) of ``stage`` on ``micro_batch``."""

    forward: bool
    stage: int
    micro_batch: int


def interleaved_order(position: int, positions: int, chunks: int, micro_batches: int) -> list[ChunkOp]:
    """The forwards and backwards of ``position`` (of ``positions``), which holds stages
    ``position + c * positions`` for ``c < chunks``, over ``micro_batches`` (a multiple of ``positions``).

    Micro-batches run in groups of ``positions``: a group through chunk 0, then chunk 1, ...
    (backwards through the chunks in reverse). Warm-up: ``2 * (positions - position - 1) +
    (chunks - 1) * positions`` forwards, then one forward one backward, then the remaining backwards.

    >>> [f"{'F' if op.forward else 'B'}{op.stage}.{op.micro_batch}" for op in interleaved_order(1, 2, 2, 2)]
    ['F1.0', 'F1.1', 'F3.0', 'B3.0', 'F3.1', 'B3.1', 'B1.0', 'B1.1']
    """
    if micro_batches % positions:
        raise ValueError(f"{micro_batches} micro-batches are not groups of {positions} positions")
    total = micro_batches * chunks
    group = positions * chunks

    def op(k: int, forward: bool) -> ChunkOp:
        chunk = (k % group) // positions
        if not forward:
            chunk = chunks - 1 - chunk
        return ChunkOp(forward, position + chunk * positions, (k // group) * positions + k % positions)

    warmup = min(2 * (positions - position - 1) + (chunks - 1) * positions, total)
    order = [op(k, True) for k in range(warmup)]
    for j in range(total - warmup):
        order += [op(warmup + j, True), op(j, False)]
    return order + [op(k, False) for k in range(total - warmup, total)]
