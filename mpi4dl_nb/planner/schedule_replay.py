"""A schedule's own step time, bubble share and peak held activations, from its action lists alone.

No layer is timed: every stage costs the same ``PhaseCosts`` (a forward, an input-gradient part,
a weight-gradient part; a whole backward ``B`` costs both parts), messages and collectives cost
nothing, and every rank has its own core. ``replay_schedule`` runs each rank's action list in
order through ``simulate.simulate`` (as the runtime would: a rank waits for the messages it
receives), so what it reports is the schedule's own bubble: the idle share of rank-time that no
faster layer or network can remove. It is the ideal the benchmarks compare a measured step with,
and the figure the zero-bubble schedules are judged by (their split backward fills the bubbles
with deferred weight-gradient work; a tick table counts ``I`` and ``W`` one tick each but ``B``
one tick too, so only a replay with costs compares them with 1F1B).

Held activations: a rank keeps a stage's activations of one micro-batch from its forward until
the last part of its backward - the ``B``, or with a split backward the ``W`` (the weight
gradients need every layer's input); ``peak_held`` counts those, per rank, at their largest.

    >>> from mpi4dl_nb.pipeline.schedules import interleaved, one_f_one_b, zbv
    >>> round(replay_schedule(one_f_one_b(2, 4)).bubble_share, 4)      # (S-1)/(m+S-1)
    0.2
    >>> round(replay_schedule(interleaved(2, 4, virtual_stages=2)).bubble_share, 4)   # (S-1)/(V*m+S-1)
    0.1111
    >>> replay = replay_schedule(zbv(2, 4))   # 2 chunks per rank: (S-1) idle chunk ops of 6m+S-1 per rank
    >>> round(replay.bubble_share, 4), replay.peak_held    # 2S chunk activations (half a stage each) on every rank
    (0.04, (4, 4))
"""

from __future__ import annotations

from dataclasses import dataclass

from ..pipeline.actions import Action, ActionKind
from ..pipeline.schedules import Schedule
from .simulate import Cost, simulate


@dataclass(frozen=True)
class PhaseCosts:
    """Seconds of one stage on one micro-batch: its forward, the input-gradient part and the
    weight-gradient part of its backward (a whole backward ``B``: both parts). The default, all
    equal, is the zero-bubble paper's unit (Qi et al. 2024: T_F = T_B = T_W)."""

    forward: float = 1.0
    input_grad: float = 1.0
    weight_grad: float = 1.0

    def __post_init__(self) -> None:
        if min(self.forward, self.input_grad, self.weight_grad) < 0:
            raise ValueError(f"{self}: a phase cannot take negative time")

    def of(self, kind: ActionKind) -> float:
        """Seconds of one action of ``kind`` (0 for sends, receives, all-reduce, optimizer)."""
        if kind is ActionKind.FORWARD:
            return self.forward
        if kind is ActionKind.BACKWARD:
            return self.input_grad + self.weight_grad
        if kind is ActionKind.BACKWARD_INPUT:
            return self.input_grad
        if kind is ActionKind.BACKWARD_WEIGHT:
            return self.weight_grad
        return 0.0


@dataclass(frozen=True)
class ScheduleRun:
    """A schedule replayed with ``PhaseCosts``: its step, each rank's busy seconds and peak held activations."""

    kind: str
    seconds: float
    busy: tuple[float, ...]          # per rank: seconds computing (F, B, I, W)
    peak_held: tuple[int, ...]       # per rank: most micro-batch stage activations held at once

    @property
    def idle_seconds(self) -> float:
        """Rank-seconds spent waiting, over all ranks."""
        return self.seconds * len(self.busy) - sum(self.busy)

    @property
    def bubble_share(self) -> float:
        """Idle share of rank-time: ``idle / (ranks x step)``."""
        total = self.seconds * len(self.busy)
        return self.idle_seconds / total if total else 0.0


def held_activations(actions: list[Action]) -> int:
    """Most (stage, micro-batch, copy) activations one rank holds at once along ``actions``: from a
    forward until the backward (``B``) or, with a split backward, until the weight-gradient part (``W``)."""
    held: set[tuple[int, int, int, int]] = set()
    peak = 0
    for action in actions:
        key = (action.replica, action.stage, action.micro_batch, action.copy)
        if action.kind is ActionKind.FORWARD:
            held.add(key)
            peak = max(peak, len(held))
        elif action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
            held.discard(key)
    return peak


def replay_schedule(schedule: Schedule, costs: PhaseCosts = PhaseCosts()) -> ScheduleRun:
    """``schedule``'s step replayed with every stage costing ``costs`` (module docstring)."""
    timelines = simulate(schedule, lambda action: Cost(costs.of(action.kind)), lambda action: 0.0)
    busy = tuple(sum(costs.of(a.kind) for a in schedule.actions(rank)) for rank in range(schedule.world_size))
    seconds = max((t.end for t in timelines), default=0.0)
    peaks = tuple(held_activations(schedule.actions(rank)) for rank in range(schedule.world_size))
    return ScheduleRun(str(schedule.kind), seconds, busy, peaks)
