"""Pipeline schedules as plain data: per rank, per tick, what happens (GPipe, 1F1B, GEMS, interleaved, zero bubble, V).

A :class:`Schedule` is built from a :class:`~mpi4dl_nb.config.ParallelConfig` and the rank
layout. Every rank gets an ordered list of :class:`Action` s; the runtime executes exactly
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

Interleaved (Megatron): 4 stages on 2 ranks, each holding 2 non-consecutive chunks of the
layer list (``virtual_stages=2``), 2 micro-batches::

    >>> print(interleaved(2, 2, virtual_stages=2).table())
    tick | rank 0    | rank 1
         | s0,s2     | s1,s3
    -----+-----------+----------
       0 | F0@s0     |
       1 | F1@s0     | F0@s1
       2 | F0@s2     | F1@s1
       3 | F1@s2     | F0@s3
       4 |           | B0@s3
       5 | B0@s2     | F1@s3
       6 |           | B1@s3
       7 | B1@s2     | B0@s1
       8 | B0@s0     | B1@s1
       9 | B1@s0     |
      10 | AR AR OPT | AR AR OPT

Zero bubble ZB-H1 (``schedule='zb1'``, ``pipeline/zero_bubble.py``): each backward is split into
``I`` (the stage input's gradient, sent back at once) and ``W`` (the parameter gradients, deferred
by ``stage`` places to fill the drain), 3 stages, 4 micro-batches::

    >>> print(zb1(3, 4).table())
    tick | rank 0 | rank 1 | rank 2
         | s0     | s1     | s2
    -----+--------+--------+-------
       0 | F0     |        |
       1 | F1     | F0     |
       2 | F2     | F1     | F0
       3 |        |        | I0
       4 |        | I0     | F1
       5 | I0     | F2     | I1
       6 | W0     | I1     | F2
       7 | F3     | W0     | I2
       8 | I1     | F3     | W0
       9 | W1     | I2     | F3
      10 | I2     | W1     | I3
      11 | W2     | I3     | W1
      12 | I3     | W2     | W2
      13 | W3     | W3     | W3
      14 | AR OPT | AR OPT | AR OPT

Zero bubble ZB-V (``schedule='zbv'``, ``pipeline/zero_bubble_v.py``): 4 stages on 2 ranks, rank r
holding stages r and 3-r (down, then back up: the loss on rank 0, where the backward starts; rank
1 hands stage 1's output to its own stage 2), each backward split into ``I`` and ``W``, 2 micro-batches::

    >>> print(zbv(2, 2).table())
    tick | rank 0    | rank 1
         | s0,s3     | s1,s2
    -----+-----------+----------
       0 | F0@s0     |
       1 | F1@s0     | F0@s1
       2 |           | F0@s2
       3 | F0@s3     | F1@s1
       4 | I0@s3     | F1@s2
       5 | W0@s3     | I0@s2
       6 | F1@s3     | W0@s2
       7 | I1@s3     | I0@s1
       8 | W1@s3     | I1@s2
       9 | I0@s0     | I1@s1
      10 | W0@s0     | W0@s1
      11 | I1@s0     | W1@s2
      12 | W1@s0     | W1@s1
      13 | AR AR OPT | AR AR OPT

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
from ..config import Choice, ParallelConfig, ScheduleKind, as_schedule_kind
from ..layout import RankRole, StageSlot, layout, stage_holders
from .interleaved import interleaved_order
from .zero_bubble import ZeroBubbleOp, zb1_order
from .zero_bubble_v import zbv_order


class ActionKind(Choice):
    """What an Action does. Values are the short names tables and traces show (``F``, ``B`` ...)."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"       # split backward: the stage input's gradient only (zero-bubble schedules)
    BACKWARD_WEIGHT = "W"      # split backward: the parameter gradients, deferred (zero-bubble schedules)
    SEND_ACT = "SEND_ACT"      # send a stage output to the next stage
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"    # send an input gradient back to the previous stage
    RECV_GRAD = "RECV_GRAD"
    ALLREDUCE = "ALLREDUCE"    # sum a stage's gradients (and BatchNorm terms) over its holders
    OPTIM = "OPTIM"            # optimizer step

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_p2p(self) -> bool:
        return self in P2P_KINDS

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)

    @property
    def carries_activation(self) -> bool:
        """Whether a send/receive moves an activation (else a gradient)."""
        return self in (ActionKind.SEND_ACT, ActionKind.RECV_ACT)


ZERO_BUBBLE_KINDS = {ZeroBubbleOp.FORWARD: ActionKind.FORWARD, ZeroBubbleOp.INPUT: ActionKind.BACKWARD_INPUT,
                     ZeroBubbleOp.WEIGHT: ActionKind.BACKWARD_WEIGHT}
COMPUTE_KINDS = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
GRADIENT_KINDS = (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)   # the backwards that send an input gradient
COSTS_SPLIT_EQUAL: dict[ActionKind, float] = {
    ActionKind.FORWARD: 1.0, ActionKind.BACKWARD: 2.0, ActionKind.BACKWARD_INPUT: 1.0, ActionKind.BACKWARD_WEIGHT: 1.0}
"""The zero-bubble paper's cost model: forward, input-gradient and weight-gradient ops take equal time."""
P2P_KINDS = (ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_GRAD)
KINDS = tuple(ActionKind)


@dataclass(frozen=True)
class Action:
    """One thing one rank does at one tick.

    ``kind``: an ActionKind (F, B, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD, ALLREDUCE, OPTIM).
    ``replica``: GEMS direction (0 primary, 1 mirror); ``dp``: full data-parallel replica;
    ``copy``: local-DP copy (which chunk of the micro-batch); ``chunk``: global chunk index
    (see module docstring); ``peer``: the other rank of a send/receive; ``group``: the
    ranks of a collective; ``tile``: this rank's tile for a spatial stage, else None.
    """

    kind: ActionKind
    rank: int
    tick: int
    stage: int = -1
    micro_batch: int = -1
    replica: int = 0
    copy: int = 0
    dp: int = 0
    chunk: int = -1
    peer: int | None = None
    tag: int = 0
    group: tuple[int, ...] = ()
    tile: int | None = None

    def label(self, local_dp: int = 1, show_stage: bool = False) -> str:
        """Short text for tables: ``F2``, ``B0.1'``, ``F1@s3`` (``show_stage``), ``AR``, ``OPT``, ``>3 act``."""
        if self.kind.is_compute:
            text = f"{self.kind}{self.micro_batch}"
            if local_dp > 1:
                text += f".{self.copy}"
            return text + ("'" if self.replica else "") + (f"@s{self.stage}" if show_stage else "")
        if self.kind is ActionKind.ALLREDUCE:
            return "AR"
        if self.kind is ActionKind.OPTIM:
            return "OPT"
        arrow = ">" if self.kind.is_send else "<"
        what = "act" if self.kind.carries_activation else "grad"
        return f"{arrow}{self.peer} {what} {self.micro_batch}" + ("'" if self.replica else "")

    def describe(self) -> str:
        """One readable sentence (for the step-through widget and logs)."""
        who = f"rank {self.rank} tick {self.tick}: "
        mirror = " (mirror)" if self.replica else ""
        if self.kind.is_compute:
            verb = VERBS[self.kind]
            return (who + f"{verb} stage {self.stage}{mirror} micro-batch {self.micro_batch}"
                    f" copy {self.copy} (chunk {self.chunk})")
        if self.kind.is_p2p:
            verb, direction = ("send", "to") if self.kind.is_send else ("recv", "from")
            noun = "activation" if self.kind.carries_activation else "gradient"
            return (who + f"{verb} {noun} of stage {self.stage}{mirror} micro-batch "
                    f"{self.micro_batch} copy {self.copy} {direction} rank {self.peer}")
        if self.kind is ActionKind.ALLREDUCE:
            return who + f"all-reduce stage {self.stage} gradients over ranks {list(self.group)}"
        return who + "optimizer step"


VERBS = {ActionKind.FORWARD: "forward", ActionKind.BACKWARD: "backward",
         ActionKind.BACKWARD_INPUT: "input-gradient backward", ActionKind.BACKWARD_WEIGHT: "weight-gradient backward"}


@dataclass(frozen=True)
class _Op:
    """A compute op of the simulation: one stage of one chunk, run by one worker."""

    kind: ActionKind
    dp: int
    replica: int
    stage: int
    micro_batch: int
    copy: int


@dataclass
class _Worker:
    """The ranks that execute one stage of one direction together (tiles), or one copy."""

    ranks: tuple[int, ...]
    order: list[_Op]
    position: int = 0


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
        done: dict[tuple[ActionKind, int, int, int, int, int], float] = {}
        free = [0.0] * self.world_size
        busy = [0.0] * self.world_size
        for action in self.global_order():
            if not action.kind.is_compute:
                continue
            op = _Op(action.kind, action.dp, action.replica, action.stage, action.micro_batch, action.copy)
            ready = max((done.get((d.kind, d.dp, d.replica, d.stage, d.micro_batch, d.copy), 0.0)
                         for d in _dependencies(op, self.cfg.split_size)), default=0.0)
            finish = max(ready, free[action.rank]) + costs[action.kind]
            free[action.rank] = finish
            busy[action.rank] += costs[action.kind]
            key = (op.kind, op.dp, op.replica, op.stage, op.micro_batch, op.copy)
            done[key] = max(done.get(key, 0.0), finish)
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
def _direction_order(kind: ScheduleKind, stage: int, num_stages: int, items: list[tuple[int, int]],
                     warmup_scale: int) -> list[tuple[ActionKind, int, int]]:
    """One worker's F/B order over ``items`` (micro_batch, copy) for one GEMS pair."""
    F, B = ActionKind.FORWARD, ActionKind.BACKWARD
    if kind is ScheduleKind.ZB1:
        return [(ZERO_BUBBLE_KINDS[op], u, k) for op, (u, k) in zb1_order(stage, num_stages, items, warmup_scale)]
    if kind is ScheduleKind.GPIPE:
        return [(F, u, k) for u, k in items] + [(B, u, k) for u, k in reversed(items)]
    count = len(items)
    warmup = min((num_stages - 1 - stage) * warmup_scale, count)
    order = [(F, u, k) for u, k in items[:warmup]]
    for j in range(count - warmup):
        order.append((F, *items[warmup + j]))
        order.append((B, *items[j]))
    order += [(B, *item) for item in items[count - warmup:]]
    return order


WorkerKey = tuple[int, int, int, int]   # (dp, replica, stage, copy); copy -1: all tiles


def _workers(cfg: ParallelConfig, roles: list[RankRole], kind: ScheduleKind) -> dict[WorkerKey, _Worker]:
    """One worker per (dp, replica, stage, copy); spatial stages use copy -1 (all tiles).

    With ``sync_batchnorm`` the copies of a stage that normalise together run as one worker
    (dp -1, copy -1): every full replica's and local-DP copy's ranks at the same tick, one
    op per micro-batch (a spatial stage runs its local-DP copies' chunks as one batch).
    """
    directions = (0, 1) if cfg.gems else (0,)
    pairs = max(cfg.times, 1)
    m, copies, stages = cfg.parts, cfg.local_dp, cfg.split_size
    holders = stage_ranks(cfg, roles)
    workers: dict[WorkerKey, _Worker] = {}
    if kind.places_chunks:
        return _chunked_workers(cfg, holders, kind)
    if cfg.sync_batchnorm:
        return _synchronised_workers(cfg, holders, kind)
    for d in range(cfg.data_parallel):
        for r in directions:
            for s in range(stages):
                spatial = s < cfg.spatial_size
                for k in ((-1,) if spatial else range(copies)):
                    ranks = holders[(d, r, s)] if spatial else (holders[(d, r, s)][k],)
                    order: list[_Op] = []
                    for p in range(pairs):
                        base = p * m
                        if spatial:
                            items = [(base + i, c) for i in range(m) for c in range(copies)]
                        else:
                            items = [(base + i, k) for i in range(m)]
                        scale = copies if spatial else 1
                        for op_kind, u, c in _direction_order(kind, s, stages, items, scale):
                            order.append(_Op(op_kind, d, r, s, u, c))
                    workers[(d, r, s, k)] = _Worker(ranks, order)
    return workers


def _synchronised_workers(cfg: ParallelConfig, holders: dict[tuple[int, int, int], tuple[int, ...]],
                          kind: ScheduleKind) -> dict[WorkerKey, _Worker]:
    """sync_batchnorm: one worker per (direction, stage) over every replica's and copy's ranks."""
    workers: dict[WorkerKey, _Worker] = {}
    m, stages = cfg.parts, cfg.split_size
    for r in ((0, 1) if cfg.gems else (0,)):
        for s in range(stages):
            ranks = tuple(sorted({rank for d in range(cfg.data_parallel) for rank in holders[(d, r, s)]}))
            order = [_Op(op_kind, -1, r, s, u, -1)
                     for p in range(max(cfg.times, 1))
                     for op_kind, u, _ in _direction_order(kind, s, stages,
                                                           [(p * m + i, -1) for i in range(m)], 1)]
            workers[(-1, r, s, -1)] = _Worker(ranks, order)
    return workers


def _chunked_workers(cfg: ParallelConfig, holders: dict[tuple[int, int, int], tuple[int, ...]],
                     kind: ScheduleKind) -> dict[WorkerKey, _Worker]:
    """Interleaved, zbv: one worker per (replica, pipeline position) over all its stages (Megatron's
    order, or the V's ``zbv_order``)."""
    F, B = ActionKind.FORWARD, ActionKind.BACKWARD
    positions = cfg.pipeline_positions
    chunks = cfg.split_size // positions
    workers: dict[WorkerKey, _Worker] = {}
    for d in range(cfg.data_parallel):
        for p in range(positions):
            if kind is ScheduleKind.ZBV:
                order = [_Op(ZERO_BUBBLE_KINDS[step.op], d, 0, step.stage, step.micro_batch, 0)
                         for step in zbv_order(p, positions, cfg.parts)]
            else:
                order = [_Op(F if op.forward else B, d, 0, op.stage, op.micro_batch, 0)
                         for op in interleaved_order(p, positions, chunks, cfg.parts)]
            workers[(d, 0, p, 0)] = _Worker(holders[(d, 0, p)], order)
    return workers


def stage_ranks(cfg: ParallelConfig, roles: list[RankRole] | None = None
                ) -> dict[tuple[int, int, int], tuple[int, ...]]:
    """(dp, replica, stage) -> ranks of that stage, by tile (spatial) or local-DP copy."""
    roles = layout(cfg) if roles is None else roles
    out: dict[tuple[int, int, int], tuple[int, ...]] = {}
    for role in roles:
        for r, slot in role.slots():
            out[(role.replica, r, slot.stage)] = slot.stage_ranks
    return out


def _dependencies(op: _Op, num_stages: int) -> list[_Op]:
    """The ops ``op`` waits for: the previous stage's forward, the next stage's backward (the same
    kind: B or I), a W its own I."""
    F = ActionKind.FORWARD
    if op.kind is F:
        if op.stage == 0:
            return []
        return [_Op(F, op.dp, op.replica, op.stage - 1, op.micro_batch, op.copy)]
    if op.kind is ActionKind.BACKWARD_WEIGHT:
        return [replace(op, kind=ActionKind.BACKWARD_INPUT)]
    if op.stage == num_stages - 1:
        return [_Op(F, op.dp, op.replica, op.stage, op.micro_batch, op.copy)]
    return [_Op(op.kind, op.dp, op.replica, op.stage + 1, op.micro_batch, op.copy)]


def _simulate(workers: dict[WorkerKey, _Worker], num_stages: int) -> dict[_Op, int]:
    """Greedy list scheduling, one op per rank per tick (a worker's ranks all busy): op -> tick."""
    finished: dict[_Op, int] = {}
    placed: dict[_Op, int] = {}
    total = sum(len(w.order) for w in workers.values())
    tick = 0
    while len(placed) < total:
        ready = []
        for worker in workers.values():
            if worker.position < len(worker.order):
                op = worker.order[worker.position]
                if all(finished.get(dep, tick) < tick for dep in _dependencies(op, num_stages)):
                    ready.append((0 if op.kind in GRADIENT_KINDS else 1, op.micro_batch, op.replica,
                                  op.stage, op.copy, worker))
        ready.sort(key=lambda item: item[:5])
        busy: set[int] = set()
        for *_, worker in ready:
            if busy.intersection(worker.ranks):
                continue
            op = worker.order[worker.position]
            busy.update(worker.ranks)
            worker.position += 1
            finished[op] = tick
            placed[op] = tick
        if not busy:
            stuck = [w.order[w.position] for w in workers.values() if w.position < len(w.order)]
            raise RuntimeError(f"schedule deadlock at tick {tick}; waiting ops: {stuck[:6]}")
        tick += 1
    return placed


def _tag(activation: bool, replica: int, micro_batch: int, copy: int, copies: int, lane: int = 0,
         micro_batches: int = 0) -> int:
    """Tag of a stage-to-stage message (see ``comm/tags.py``): class, then (virtual-stage lane x
    micro-batch) x copy (``lane``: the sender's chunk of an interleaved rank, of ``micro_batches`` each)."""
    klass = 2 * replica + (0 if activation else 1)
    unit = lane * micro_batches + micro_batch
    return PIPELINE.tag(klass * PIPELINE_SPAN + (unit * copies + copy) % PIPELINE_SPAN)


def _message_tag(cfg: ParallelConfig, op: _Op, neighbour: int) -> int:
    """The tag of op's message with stage ``neighbour``; its lane: the interleaved chunk of the lower stage."""
    lane = min(op.stage, neighbour) // cfg.pipeline_positions
    return _tag(op.kind is ActionKind.FORWARD, op.replica, op.micro_batch, op.copy, cfg.local_dp, lane, cfg.parts)


def chunk_index(cfg: ParallelConfig, dp: int, replica: int, micro_batch: int, copy: int) -> int:
    """Global chunk number of (full replica, GEMS direction, micro-batch, local-DP copy)."""
    groups = 2 * cfg.times if cfg.gems else 1
    pair, i = divmod(micro_batch, cfg.parts)
    g = 2 * pair + replica if cfg.gems else 0
    return ((dp * groups + g) * cfg.parts + i) * cfg.local_dp + copy


def build_schedule(cfg: ParallelConfig, kind: ScheduleKind | str | None = None) -> Schedule:
    """The whole step for ``cfg``: ``kind`` 'gpipe', '1f1b' or 'interleaved' (default ``cfg.schedule``).

    With ``cfg.times >= 1`` both GEMS directions run this per-direction policy at once
    on the same ranks, the ``times`` pairs one after another.
    """
    kind = cfg.schedule if kind is None else as_schedule_kind(kind)
    roles = layout(cfg)
    placed = _simulate(_workers(cfg, roles, kind), cfg.split_size)
    holders = _Holders(cfg, stage_ranks(cfg, roles))
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


@dataclass(frozen=True)
class _Holders:
    """The ranks of each (dp, replica, stage) of ``cfg`` (``stage_ranks``): who runs an op and whom it exchanges
    its chunk with."""

    cfg: ParallelConfig
    ranks: dict[tuple[int, int, int], tuple[int, ...]]

    def spatial(self, stage: int) -> bool:
        return stage < self.cfg.spatial_size

    def runs(self, op: _Op) -> Iterator[tuple[_Op, tuple[int, ...]]]:
        """The ops ``op`` stands for with their ranks: a sync_batchnorm worker's op (``dp == -1``) as one op per
        replica and copy (copies in order), else op itself; every tile of a spatial stage, else its copy's rank."""
        subs = ([_Op(op.kind, d, op.replica, op.stage, op.micro_batch, k)
                 for d in range(self.cfg.data_parallel) for k in range(self.cfg.local_dp)] if op.dp == -1 else [op])
        for sub in subs:
            ranks = self.ranks[(sub.dp, sub.replica, sub.stage)]
            yield sub, (ranks if self.spatial(sub.stage) else (ranks[sub.copy],))

    def peers(self, op: _Op, rank: int, neighbour: int) -> list[int]:
        """Ranks of stage ``neighbour`` that exchange op's chunk with ``rank``."""
        ranks = self.ranks[(op.dp, op.replica, neighbour)]
        mine = self.ranks[(op.dp, op.replica, op.stage)]
        if self.spatial(neighbour) and self.spatial(op.stage):
            return [ranks[mine.index(rank)]]         # tile t <-> tile t
        if self.spatial(neighbour):
            return list(ranks)                         # hand-off: every tile
        return [ranks[op.copy]]                        # copy k <-> copy k

    def actions_of_rank(self, op: _Op, tick: int, rank: int) -> list[tuple[int, int, Action]]:
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


def _neighbours(op: _Op, num_stages: int) -> tuple[int | None, int | None, ActionKind, ActionKind]:
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
