"""Schedule ticks: each worker's compute ops placed greedily on the first tick their inputs are done (pure).

At each tick every worker whose next op has its inputs done on an earlier tick starts it, backwards first, unless
one of its ranks is already busy (a worker: the ranks that run one stage's ops together, ``worker_orders``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from .actions import GRADIENT_KINDS, ActionKind


@dataclass(frozen=True)
class ComputeOp:
    """A compute op of the simulation: one stage of one chunk, run by one worker (a sync_batchnorm worker's op:
    ``dp`` and ``copy`` -1, every full replica's and local-DP copy's at once)."""

    kind: ActionKind
    dp: int
    replica: int
    stage: int
    micro_batch: int
    copy: int


@dataclass
class Worker:
    """The ranks that execute one stage of one direction together (tiles), or one copy, and their ops in order."""

    ranks: tuple[int, ...]
    order: list[ComputeOp]
    position: int = 0

    @property
    def next_op(self) -> ComputeOp | None:
        return self.order[self.position] if self.position < len(self.order) else None


def dependencies(op: ComputeOp, num_stages: int) -> list[ComputeOp]:
    """The ops ``op`` waits for: the previous stage's forward, the next stage's backward (the same
    kind: B or I), a W its own I."""
    forward = ActionKind.FORWARD
    if op.kind is forward:
        return [] if op.stage == 0 else [replace(op, stage=op.stage - 1)]
    if op.kind is ActionKind.BACKWARD_WEIGHT:
        return [replace(op, kind=ActionKind.BACKWARD_INPUT)]
    if op.stage == num_stages - 1:
        return [replace(op, kind=forward)]
    return [replace(op, stage=op.stage + 1)]


def place_on_ticks(workers: Sequence[Worker], num_stages: int) -> dict[ComputeOp, int]:
    """Greedy list scheduling, one op per rank per tick (a worker's ranks all busy): op -> tick."""
    placed: dict[ComputeOp, int] = {}
    total = sum(len(w.order) for w in workers)
    tick = 0
    while len(placed) < total:
        busy: set[int] = set()
        for worker, op in _ready(workers, placed, tick, num_stages):
            if busy.isdisjoint(worker.ranks):
                busy.update(worker.ranks)
                worker.position += 1
                placed[op] = tick
        if not busy:
            stuck = [w.next_op for w in workers if w.next_op is not None]
            raise RuntimeError(f"schedule deadlock at tick {tick}; waiting ops: {stuck[:6]}")
        tick += 1
    return placed


def _ready(workers: Sequence[Worker], placed: dict[ComputeOp, int], tick: int,
           num_stages: int) -> list[tuple[Worker, ComputeOp]]:
    """The workers whose next op may start at ``tick`` (its inputs placed on earlier ticks), with that op, by
    priority: the backwards that send an input gradient first, then micro-batch, replica, stage, copy."""
    ready = [(worker, op) for worker in workers if (op := worker.next_op) is not None
             and all(placed.get(dep, tick) < tick for dep in dependencies(op, num_stages))]
    return sorted(ready, key=lambda item: _priority(item[1]))


def _priority(op: ComputeOp) -> tuple[int, int, int, int, int]:
    return (0 if op.kind in GRADIENT_KINDS else 1, op.micro_batch, op.replica, op.stage, op.copy)
