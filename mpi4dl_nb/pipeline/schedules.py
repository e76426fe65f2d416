"""Pipeline schedules as plain data: per rank, per tick, what happens (GPipe, 1F1B, GEMS, interleaved, zero bubble, V).

A :class:`Schedule` is built from a :class:`~mpi4dl_nb.config.ParallelConfig` and the rank
layout (``build_schedule``: each worker's compute ops in order, ``worker_orders``; placed on ticks,
``tick_placement``; each op's receives, compute and sends on its ranks, here). Every rank gets an
ordered list of :class:`~mpi4dl_nb.pipeline.actions.Action` s; the runtime executes exactly
that list, and a :class:`Stepper` walks all ranks' actions in one global order (the
step-through widget drives the same object). GPipe, 3 stages, 4 micro-batches::

    >>> print(gpipe(3, 4).table())
    tick | rank 0 | rank 1 | rank 2
         | s0     | s1     | s2
    -----+--------+--------+-------
       0 | F0     |        |
       1 | F1     | F0     |
       2 | F2     | F1     | F0
       3 | F3     | F2     | F1
       4 |        | F3     | F2
       5 |        |        | F3
       6 |        |        | B3
       7 |        | B3     | B2
       8 | B3     | B2     | B1
       9 | B2     | B1     | B0
      10 | B1     | B0     |
      11 | B0     |        |
      12 | AR OPT | AR OPT | AR OPT

Interleaved (``virtual_stages``), zero bubble ZB-H1 (``schedule='zb1'``, ``pipeline/zero_bubble.py``: each
backward split into ``I``, the input's gradient, and ``W``, the weights', deferred) and ZB-V (``'zbv'``,
``pipeline/zero_bubble_v.py``) print the same way; their tables are in tests/pipeline/test_schedule_tables.py.

Cells read ``F<i>`` / ``B<i>``: forward / backward of micro-batch ``i`` (``I<i>`` / ``W<i>``: its
input-gradient / weight-gradient half; ``.k`` appended:
local-DP copy ``k``; a trailing ``'``: the GEMS mirror replica; ``@s<j>``: of stage ``j``, where
a rank holds several). ``AR`` is the gradient
(and BatchNorm statistics) all-reduce of the rank's stages, ``OPT`` the optimizer step.

Work unit ("chunk"): the global batch is cut into ``data_parallel x G x parts x local_dp``
equal consecutive chunks (``G = 2*times`` with GEMS, else 1), numbered in that nesting
order. Chunk ``((d*G + g)*parts + i)*local_dp + k`` is micro-batch ``i`` of GEMS chunk
``g`` of full replica ``d``, local-DP copy ``k``; GEMS chunk ``g = 2p + r`` is pair ``p``
of direction ``r`` (0 primary, 1 mirror). Spatial stages run every copy's chunk
separately, so every stage sees exactly one chunk per forward.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ..comm.tags import PIPELINE, PIPELINE_SPAN
from ..config import ParallelConfig, ScheduleKind, as_schedule_kind
from ..layout import RankRole, StageSlot, layout, stage_holders
from .actions import Action, ActionKind
from .tick_placement import ComputeOp, dependencies, place_on_ticks
from .worker_orders import JOINT, StageHolders, worker_orders

COSTS_SPLIT_EQUAL: dict[ActionKind, float] = {
    ActionKind.FORWARD: 1.0, ActionKind.BACKWARD: 2.0, ActionKind.BACKWARD_INPUT: 1.0, ActionKind.BACKWARD_WEIGHT: 1.0}
"""The zero-bubble paper's cost model: forward, input-gradient and weight-gradient ops take equal time."""


@dataclass
class Schedule:
    """Every rank's actions for one training step, plus what built them."""

    cfg: ParallelConfig
    kind: ScheduleKind
    num_ticks: int
    per_rank: list[list[Action]] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.per_rank)

    def actions(self, rank: int) -> list[Action]:
        """Rank ``rank``'s actions in execution order."""
        return self.per_rank[rank]

    def global_order(self) -> list[Action]:
        """All actions of all ranks in one order consistent with every dependency.

        Tick by tick; inside a tick rank by rank, each rank's receives, compute, sends.
        """
        order = [a for actions in self.per_rank for a in actions]
        position = {id(a): i for actions in self.per_rank for i, a in enumerate(actions)}
        return sorted(order, key=lambda a: (a.tick, a.rank, position[id(a)]))

    def compute_grid(self) -> list[list[list[Action]]]:
        """grid[tick][rank] = the non-p2p actions of that rank at that tick."""
        grid: list[list[list[Action]]] = [[[] for _ in self.per_rank] for _ in range(self.num_ticks)]
        for rank, actions in enumerate(self.per_rank):
            for action in actions:
                if not action.kind.is_p2p:
                    grid[action.tick][rank].append(action)
        return grid

    def table(self, show_comm: bool = False) -> str:
        """ASCII table, ticks down, ranks across (see the module docstring).

        ``show_comm=True`` adds each rank's sends (``>peer``) and receives (``<peer``).
        """
        roles = layout(self.cfg)
        headers = [f"rank {r}" for r in range(self.world_size)]
        subheads = [_role_text(role) for role in roles]
        rows: list[list[str]] = []
        for tick in range(self.num_ticks):
            cells = []
            for rank in range(self.world_size):
                acts = [a for a in self.per_rank[rank] if a.tick == tick
                        and (show_comm or not a.kind.is_p2p)]
                cells.append(" ".join(a.label(self.cfg.local_dp, self.cfg.virtual_stages > 1) for a in acts))
            rows.append([str(tick)] + cells)
        widths = [max(len("tick"), *(len(r[0]) for r in rows))]
        for c in range(self.world_size):
            widths.append(max(len(headers[c]), len(subheads[c]), *(len(r[c + 1]) for r in rows)))
        def line(cells: Sequence[str], first: str) -> str:
            parts = [first.rjust(widths[0])] + [cell.ljust(w) for cell, w in zip(cells, widths[1:])]
            return " | ".join(parts).rstrip()
        out = [line(headers, "tick"), line(subheads, ""),
               "-+-".join("-" * w for w in widths)]
        out += [line(r[1:], r[0]) for r in rows]
        return "\n".join(out)

    def bubble_share(self, costs: Mapping[ActionKind, float] | None = None) -> float:
        """Idle share of the compute time (the final all-reduce left out): ``idle / (span x ranks)``.

        Without ``costs`` every op is one tick. With ``costs`` (time per compute kind, e.g.
        ``COSTS_SPLIT_EQUAL``: F = I = W = 1, B = I + W = 2) each rank's ops are replayed in its order,
        each starting when its rank is free and its inputs are done. Chunks of an interleaved schedule
        are 1/V of a stage, so the share compares across schedules when the stages are equal."""
        if costs is not None:
            span, idle = self.replay(costs)
            return idle / (span * self.world_size) if span else 0.0
        compute = [a for actions in self.per_rank for a in actions if a.kind.is_compute]
        if not compute:
            return 0.0
        ticks = 1 + max(a.tick for a in compute)
        busy = {(a.rank, a.tick) for a in compute}
        slots = ticks * self.world_size
        return (slots - len(busy)) / slots

    def replay(self, costs: Mapping[ActionKind, float]) -> tuple[float, float]:
        """(span, idle time summed over the ranks) of the compute ops timed by ``costs``.

        A forward waits for the previous stage's forward of its chunk, a B or I for the next
        stage's (the last stage: its own forward), a W for its I; every rank runs its ops in order."""
        done: dict[ComputeOp, float] = {}
        free = [0.0] * self.world_size
        busy = [0.0] * self.world_size
        for action in self.global_order():
            if not action.kind.is_compute:
                continue
            op = ComputeOp(action.kind, action.dp, action.replica, action.stage, action.micro_batch, action.copy)
            ready = max((done.get(d, 0.0) for d in dependencies(op, self.cfg.split_size)), default=0.0)
            finish = max(ready, free[action.rank]) + costs[action.kind]
            free[action.rank] = finish
            busy[action.rank] += costs[action.kind]
            done[op] = max(done.get(op, 0.0), finish)
        span = max(free, default=0.0)
        return span, sum(span - b for b in busy)

    def stepper(self, ranks: Iterable[int] | None = None) -> Stepper:
        """A Stepper over this schedule (all ranks, or only ``ranks``)."""
        return Stepper(self, ranks)

    def chunk_size(self, batch_size: int) -> int:
        """Samples per chunk for a global batch of ``batch_size`` (ConfigError if uneven)."""
        self.cfg.validate(batch_size=batch_size)
        return batch_size // self.cfg.batch_divisor


def _role_text(role: RankRole) -> str:
    def slot(s: StageSlot, mark: str) -> str:
        return f"s{s.stage}{mark}" + (f"t{s.tile}" if s.spatial else "")
    text = ",".join(slot(s, "") for s in (role.primary, *role.chunks))
    if role.mirror is not None:
        text += "," + slot(role.mirror, "'")
    return text


class Stepper:
    """Walks a schedule one action at a time in its global order.

    The runtime runs its own rank's part of this order (computed once); a notebook iterates one
    over all ranks to show the run step by step. ``step()`` returns the next action (None
    when finished); ``history`` holds the actions already taken.
    """

    def __init__(self, schedule: Schedule, ranks: Iterable[int] | None = None) -> None:
        self.schedule = schedule
        wanted = None if ranks is None else set(ranks)
        self._order = [a for a in schedule.global_order() if wanted is None or a.rank in wanted]
        self._position = 0
        self.history: list[Action] = []

    def __len__(self) -> int:
        return len(self._order)

    @property
    def done(self) -> bool:
        return self._position >= len(self._order)

    @property
    def position(self) -> int:
        return self._position

    def peek(self) -> Action | None:
        """The next action without taking it."""
        return None if self.done else self._order[self._position]

    def step(self) -> Action | None:
        """Take and return the next action."""
        action = self.peek()
        if action is not None:
            self._position += 1
            self.history.append(action)
        return action

    def reset(self) -> None:
        self._position = 0
        self.history.clear()

    def __iter__(self) -> Iterator[Action]:
        while not self.done:
            action = self.step()
            assert action is not None
            yield action


# --------------------------------------------------------------------- generation
def build_schedule(cfg: ParallelConfig, kind: ScheduleKind | str | None = None) -> Schedule:
    """The whole step for ``cfg`` under schedule ``kind`` (a ScheduleKind or its name; default ``cfg.schedule``).

    With ``cfg.times >= 1`` both GEMS directions run this per-direction policy at once
    on the same ranks, the ``times`` pairs one after another.
    """
    kind = cfg.schedule if kind is None else as_schedule_kind(kind)
    roles = layout(cfg)
    holders = _Holders(cfg, stage_ranks(cfg, roles))
    placed = place_on_ticks(worker_orders(cfg, holders.ranks, kind), cfg.split_size)
    per_rank: list[list[tuple[int, int, Action]]] = [[] for _ in roles]
    for op, tick in placed.items():
        for sub, ranks in holders.runs(op):
            for rank in ranks:
                per_rank[rank] += holders.actions_of_rank(sub, tick, rank)
    final = 1 + max(placed.values())
    for role in roles:
        per_rank[role.rank] += _step_end(cfg, role, final)
    ordered = [[a for _, _, a in sorted(seq, key=lambda item: (item[0], item[1]))]
               for seq in per_rank]
    return Schedule(cfg, kind, final + 1, ordered)


def stage_ranks(cfg: ParallelConfig, roles: list[RankRole] | None = None) -> StageHolders:
    """(dp, replica, stage) -> ranks of that stage, by tile (spatial) or local-DP copy."""
    roles = layout(cfg) if roles is None else roles
    out: StageHolders = {}
    for role in roles:
        for r, slot in role.slots():
            out[(role.replica, r, slot.stage)] = slot.stage_ranks
    return out


def _message_tag(cfg: ParallelConfig, op: ComputeOp, neighbour: int) -> int:
    """Tag of op's message with stage ``neighbour`` (see ``comm/tags.py``): class (direction, activation or
    gradient), then (virtual-stage lane x micro-batch) x copy (lane: the interleaved chunk of the lower stage)."""
    klass = 2 * op.replica + (0 if op.kind is ActionKind.FORWARD else 1)
    unit = min(op.stage, neighbour) // cfg.pipeline_positions * cfg.parts + op.micro_batch
    return PIPELINE.tag(klass * PIPELINE_SPAN + (unit * cfg.local_dp + op.copy) % PIPELINE_SPAN)


def chunk_index(cfg: ParallelConfig, dp: int, replica: int, micro_batch: int, copy: int) -> int:
    """Global chunk number of (full replica, GEMS direction, micro-batch, local-DP copy)."""
    groups = 2 * cfg.times if cfg.gems else 1
    pair, i = divmod(micro_batch, cfg.parts)
    g = 2 * pair + replica if cfg.gems else 0
    return ((dp * groups + g) * cfg.parts + i) * cfg.local_dp + copy


@dataclass(frozen=True)
class _Holders:
    """The ranks of each (dp, replica, stage) of ``cfg`` (``stage_ranks``): who runs an op and whom it exchanges
    its chunk with."""

    cfg: ParallelConfig
    ranks: StageHolders

    def spatial(self, stage: int) -> bool:
        return stage < self.cfg.spatial_size

    def runs(self, op: ComputeOp) -> Iterator[tuple[ComputeOp, tuple[int, ...]]]:
        """The ops ``op`` stands for with their ranks: a sync_batchnorm worker's op (``dp`` JOINT) as one op per
        replica and copy (copies in order), else op itself; every tile of a spatial stage, else its copy's rank."""
        subs = ([ComputeOp(op.kind, d, op.replica, op.stage, op.micro_batch, k)
                 for d in range(self.cfg.data_parallel) for k in range(self.cfg.local_dp)] if op.dp == JOINT else [op])
        for sub in subs:
            ranks = self.ranks[(sub.dp, sub.replica, sub.stage)]
            yield sub, (ranks if self.spatial(sub.stage) else (ranks[sub.copy],))

    def peers(self, op: ComputeOp, rank: int, neighbour: int) -> list[int]:
        """Ranks of stage ``neighbour`` that exchange op's chunk with ``rank``."""
        ranks = self.ranks[(op.dp, op.replica, neighbour)]
        mine = self.ranks[(op.dp, op.replica, op.stage)]
        if self.spatial(neighbour) and self.spatial(op.stage):
            return [ranks[mine.index(rank)]]         # tile t <-> tile t
        if self.spatial(neighbour):
            return list(ranks)                         # hand-off: every tile
        return [ranks[op.copy]]                        # copy k <-> copy k

    def actions_of_rank(self, op: ComputeOp, tick: int, rank: int) -> list[tuple[int, int, Action]]:
        """(tick, order, action) of ``op`` on ``rank``: its receives (order 0), the compute (1), its sends (2)."""
        mine = self.ranks[(op.dp, op.replica, op.stage)]
        common = Action(op.kind, rank=rank, tick=tick, stage=op.stage, micro_batch=op.micro_batch,
                        replica=op.replica, copy=op.copy, dp=op.dp,
                        chunk=chunk_index(self.cfg, op.dp, op.replica, op.micro_batch, op.copy),
                        tile=mine.index(rank) if self.spatial(op.stage) else None)
        before, after, recv_kind, send_kind = _neighbours(op, self.cfg.split_size)
        seq = []
        if before is not None:
            tag = _message_tag(self.cfg, op, before)
            seq += [(tick, 0, replace(common, kind=recv_kind, peer=peer, tag=tag))
                    for peer in self.peers(op, rank, before)]
        seq.append((tick, 1, common))
        if after is not None:
            tag = _message_tag(self.cfg, op, after)
            seq += [(tick, 2, replace(common, kind=send_kind, peer=peer, tag=tag))
                    for peer in self.peers(op, rank, after)]
        return seq


def _neighbours(op: ComputeOp, num_stages: int) -> tuple[int | None, int | None, ActionKind, ActionKind]:
    """The stage op receives from and the one it sends to (None: none), and the kinds of those messages."""
    first, last = op.stage == 0, op.stage == num_stages - 1
    if op.kind is ActionKind.FORWARD:
        return (None if first else op.stage - 1, None if last else op.stage + 1,
                ActionKind.RECV_ACT, ActionKind.SEND_ACT)
    if op.kind is ActionKind.BACKWARD_WEIGHT:   # parameter gradients: nothing moves
        return None, None, ActionKind.RECV_GRAD, ActionKind.SEND_GRAD
    return (None if last else op.stage + 1, None if first else op.stage - 1,
            ActionKind.RECV_GRAD, ActionKind.SEND_GRAD)


def _step_end(cfg: ParallelConfig, role: RankRole, final: int) -> list[tuple[int, int, Action]]:
    """A rank's last tick: the gradient all-reduce of each of its stages, then the optimizer step."""
    reduces = [(final, 3 + s, Action(ActionKind.ALLREDUCE, role.rank, final, stage=s, dp=role.replica,
                                     group=tuple(stage_holders(cfg, s)))) for s in role.stages]
    return [*reduces, (final, 3 + cfg.split_size, Action(ActionKind.OPTIM, role.rank, final, dp=role.replica))]


def _pipeline_cfg(num_stages: int, num_micro_batches: int, kind: ScheduleKind, times: int = 0
                  ) -> ParallelConfig:
    return ParallelConfig(split_size=num_stages, spatial_size=0, parts=num_micro_batches,
                          times=times, schedule=kind)


def gpipe(num_stages: int, num_micro_batches: int) -> Schedule:
    """GPipe on a plain pipeline: all forwards, then all backwards (last micro-batch first)."""
    return build_schedule(_pipeline_cfg(num_stages, num_micro_batches, ScheduleKind.GPIPE))


def one_f_one_b(num_stages: int, num_micro_batches: int) -> Schedule:
    """1F1B (PipeDream-flush): warm-up forwards, then one forward one backward, then drain."""
    return build_schedule(_pipeline_cfg(num_stages, num_micro_batches, ScheduleKind.ONE_F_ONE_B))


def gems(num_stages: int, num_micro_batches: int = 1, times: int = 1,
         kind: ScheduleKind | str = ScheduleKind.GPIPE) -> Schedule:
    """GEMS bidirectional: a mirror replica on the same ranks in reverse stage order."""
    return build_schedule(_pipeline_cfg(num_stages, num_micro_batches, as_schedule_kind(kind), times))


def zb1(num_stages: int, num_micro_batches: int) -> Schedule:
    """Zero-bubble ZB-H1 on a plain pipeline: 1F1B with each backward split into I and W (W deferred)."""
    return build_schedule(_pipeline_cfg(num_stages, num_micro_batches, ScheduleKind.ZB1))


def zbv(num_positions: int, num_micro_batches: int) -> Schedule:
    """Zero-bubble ZB-V: 2 chunks per rank, rank r holding stages r and 2P-1-r, backward split into I and W."""
    return build_schedule(ParallelConfig(split_size=2 * num_positions, spatial_size=0, parts=num_micro_batches,
                                         schedule=ScheduleKind.ZBV))


def interleaved(num_positions: int, num_micro_batches: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B: ``virtual_stages`` chunks per rank, stage s on rank s mod ``num_positions``."""
    return build_schedule(ParallelConfig(split_size=num_positions * virtual_stages, spatial_size=0,
                                         parts=num_micro_batches, schedule=ScheduleKind.INTERLEAVED,
                                         virtual_stages=virtual_stages))


def ideal_bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    """Idle share of a GPipe/1F1B pipeline with equal stages: (S-1)/(m+S-1)."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)
