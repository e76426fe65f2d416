"""Which compute ops each worker of a schedule runs, in its order (GPipe, 1F1B, ZB-H1, interleaved, ZB-V; pure).

A worker (``tick_placement.Worker``) is one stage of one GEMS direction of one full replica: a spatial stage's
tiles together (every local-DP copy's chunk in turn), a layer-parallel stage once per copy; with ``sync_batchnorm``
every replica's and copy's ranks at once. Interleaved and ZB-V: one worker per pipeline position over its stages.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import product
from typing import NamedTuple

from ..config import ParallelConfig, ScheduleKind
from .actions import ActionKind
from .interleaved import interleaved_order
from .tick_placement import ComputeOp, Worker
from .zero_bubble import ZeroBubbleOp, zb1_order
from .zero_bubble_v import zbv_order

ZERO_BUBBLE_KINDS = {ZeroBubbleOp.FORWARD: ActionKind.FORWARD, ZeroBubbleOp.INPUT: ActionKind.BACKWARD_INPUT,
                     ZeroBubbleOp.WEIGHT: ActionKind.BACKWARD_WEIGHT}
JOINT = -1   # the dp and copy of a sync_batchnorm worker's ops: every full replica's and local-DP copy's at once
StageHolders = dict[tuple[int, int, int], tuple[int, ...]]   # (dp, replica, stage) -> its ranks (``stage_ranks``)
Unit = tuple[int, int]                                        # (micro_batch, copy)


class StageWorker(NamedTuple):
    """A worker of one stage: its full replica, GEMS direction, stage, ranks, and the local-DP copies it runs."""

    dp: int
    replica: int
    stage: int
    ranks: tuple[int, ...]
    copies: tuple[int, ...]


def worker_orders(cfg: ParallelConfig, holders: StageHolders, kind: ScheduleKind) -> list[Worker]:
    """Every worker of ``cfg``'s step under schedule ``kind`` with its compute ops in order (module docstring)."""
    if kind.places_chunks:
        return [Worker(holders[(dp, 0, position)], _position_order(cfg, kind, dp, position))
                for dp, position in product(range(cfg.data_parallel), range(cfg.pipeline_positions))]
    return [Worker(worker.ranks, _stage_order(cfg, kind, worker)) for worker in _stage_workers(cfg, holders)]


def _stage_workers(cfg: ParallelConfig, holders: StageHolders) -> Iterator[StageWorker]:
    """The workers of every stage in order of full replica, direction, stage, copy (sync_batchnorm: one per
    direction and stage over every replica's ranks)."""
    directions = (0, 1) if cfg.gems else (0,)
    if cfg.sync_batchnorm:
        for replica, stage in product(directions, range(cfg.split_size)):
            joined = {rank for dp in range(cfg.data_parallel) for rank in holders[(dp, replica, stage)]}
            yield StageWorker(JOINT, replica, stage, tuple(sorted(joined)), (JOINT,))
        return
    for dp, replica, stage in product(range(cfg.data_parallel), directions, range(cfg.split_size)):
        ranks = holders[(dp, replica, stage)]
        if stage < cfg.spatial_size:   # the tiles run every copy's chunk, one after another
            yield StageWorker(dp, replica, stage, ranks, tuple(range(cfg.local_dp)))
        else:
            yield from (StageWorker(dp, replica, stage, (ranks[copy],), (copy,)) for copy in range(cfg.local_dp))


def _stage_order(cfg: ParallelConfig, kind: ScheduleKind, worker: StageWorker) -> list[ComputeOp]:
    """The worker's ops: the GEMS pairs one after another, each in ``kind``'s order over its micro-batches."""
    return [ComputeOp(op, worker.dp, worker.replica, worker.stage, micro_batch, copy)
            for pair in range(max(cfg.times, 1))
            for op, (micro_batch, copy) in _pair_order(kind, worker.stage, cfg.split_size,
                                                       _pair_units(cfg, pair, worker.copies), len(worker.copies))]


def _pair_units(cfg: ParallelConfig, pair: int, copies: Sequence[int]) -> list[Unit]:
    """The (micro_batch, copy) units of GEMS pair ``pair`` of a worker running ``copies``, by micro-batch."""
    first = pair * cfg.parts
    return [(first + index, copy) for index in range(cfg.parts) for copy in copies]


def _pair_order(kind: ScheduleKind, stage: int, num_stages: int, units: list[Unit],
                warmup_scale: int) -> list[tuple[ActionKind, Unit]]:
    """One worker's order over ``units`` of one GEMS pair: GPipe's, ZB-H1's, else 1F1B's (a warm-up of
    ``warmup_scale`` forwards per later stage, then one forward one backward, then the drain)."""
    forward, backward = ActionKind.FORWARD, ActionKind.BACKWARD
    if kind is ScheduleKind.ZB1:
        return [(ZERO_BUBBLE_KINDS[op], unit) for op, unit in zb1_order(stage, num_stages, units, warmup_scale)]
    if kind is ScheduleKind.GPIPE:
        return [(forward, unit) for unit in units] + [(backward, unit) for unit in reversed(units)]
    count = len(units)
    warmup = min((num_stages - 1 - stage) * warmup_scale, count)
    order = [(forward, unit) for unit in units[:warmup]]
    for oldest, newest in zip(units, units[warmup:]):
        order += [(forward, newest), (backward, oldest)]
    return order + [(backward, unit) for unit in units[count - warmup:]]


def _position_order(cfg: ParallelConfig, kind: ScheduleKind, dp: int, position: int) -> list[ComputeOp]:
    """Interleaved, zbv: the ops of one pipeline position over all its stages (Megatron's order, or the V's)."""
    positions = cfg.pipeline_positions
    if kind is ScheduleKind.ZBV:
        return [ComputeOp(ZERO_BUBBLE_KINDS[step.op], dp, 0, step.stage, step.micro_batch, 0)
                for step in zbv_order(position, positions, cfg.parts)]
    return [ComputeOp(ActionKind.FORWARD if op.forward else ActionKind.BACKWARD, dp, 0, op.stage, op.micro_batch, 0)
            for op in interleaved_order(position, positions, cfg.split_size // positions, cfg.parts)]
