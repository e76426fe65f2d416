"""The crowded-core model: what ranks outnumbering a CPU node's cores cost a step.

Three terms, each calibrated on the job (``measure.calibration``'s crowded rounds): a meeting
of ranks (a halo exchange, a BatchNorm or gradient sum) costs more while ranks wait to be
scheduled (``Crowding.crowded_meeting``, ``Crowding.meeting_extra``); the ranks computing are
slowed by the waiting ranks' wake-ups on their cores (``SharedCores.beside_waiting``); and more
ranks computing than cores share them (``SharedCores.rate``, processor sharing). It applies only
on a CPU job whose ranks outnumber the cores (``crowds``): with a GPU per rank, or a core per
rank, no term of it enters a prediction and the calibration does not run its rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def crowds(cores: int | None, ranks: int) -> bool:
    """Whether ``ranks`` ranks outnumber the ``cores`` they share (None: a device each, never)."""
    return cores is not None and ranks > cores


@dataclass(frozen=True)
class Crowding:
    """The calibrated crowded-core terms of a job: ``sync`` seconds more per meeting of all
    ranks with ``sync_work`` seconds of compute between meetings (``sync_short`` with
    ``short_work``; None: ``sync``), measured with ``crowd_members`` ranks (0: the
    configuration's); ``waiting_slowdown``: how much slower the ranks filling the cores compute
    while the others wait. The default: no crowding measured."""

    sync: float = 0.0
    sync_short: float | None = None
    sync_work: float = 1e-3
    short_work: float = 0.25e-3
    waiting_slowdown: float = 1.0
    crowd_members: int = 0

    def crowded_meeting(self, work: float) -> float:
        """Extra seconds of a meeting while ranks outnumber cores, ``work`` seconds of compute
        after the previous one: between the two measurements, linear in ``work``, clamped."""
        if self.sync_short is None or work >= self.sync_work:
            return self.sync
        if work <= self.short_work:
            return self.sync_short
        share = (work - self.short_work) / (self.sync_work - self.short_work)
        return self.sync_short + share * (self.sync - self.sync_short)

    def meeting_extra(self, members: int, work: float, cores: int, ranks: int) -> float:
        """Seconds a meeting of ``members`` ranks on ``cores`` costs beyond an uncrowded one, in a
        job of ``ranks``: none while they have a core each; more members take turns, and each
        meeting waits for some to be scheduled: linearly towards ``crowded_meeting(work)`` at the
        crowded measurement's ranks (``crowd_members``, else ``ranks``)."""
        crowd = self.crowd_members or ranks
        if members <= cores or crowd <= cores:
            return 0.0
        return self.crowded_meeting(work) * min(1.0, (members - cores) / (crowd - cores))

    def describe(self) -> str:
        """What the terms add, as a phrase (empty when nothing)."""
        parts = [f"{self.sync * 1e3:.2f} ms more per meeting of ranks sharing cores"] if self.sync else []
        if self.waiting_slowdown > 1:
            parts.append(f"compute {self.waiting_slowdown:.2f}x slower beside waiting ranks")
        return ", ".join(parts)


NO_CROWDING = Crowding()


@dataclass(frozen=True)
class SharedCores:
    """The simulator's core sharing: ``ranks`` ranks on ``cores`` cores, the ranks filling the
    cores ``waiting_slowdown`` times slower while the others wait (``simulate``'s docstring)."""

    cores: int
    ranks: int
    waiting_slowdown: float = 1.0

    def crowding(self, demand: float) -> float:
        """How crowded the cores are with ``demand`` cores' worth of ranks computing: 0 up to one
        rank per core, 1 with every rank of the step running (where ``Cost.crowded`` was
        measured), linear between."""
        if demand <= self.cores:
            return 0.0
        return min(1.0, (demand - self.cores) / max(1, self.ranks - self.cores))

    def beside_waiting(self, computing: int) -> float:
        """Slowdown of the computing ranks from the others waiting on shared cores (their
        wake-ups): ``waiting_slowdown`` was measured with the cores busy and every other rank
        waiting; fewer waiting ranks cost proportionally less."""
        if self.waiting_slowdown <= 1.0 or not computing:
            return 1.0
        measured_waiters = self.ranks - min(self.cores, self.ranks - 1)
        return 1.0 + (self.waiting_slowdown - 1.0) * min(1.0, (self.ranks - computing) / max(1, measured_waiters))

    def rate(self, computing: int, stalled_by: int, exposed: float) -> float:
        """Share of full speed an action computes at while ``computing`` ranks run: the cores shared,
        slowed by the waiting ranks' wake-ups in its ``exposed`` share (all its time in a group with
        more members than cores: at a meeting its core runs another member), and by every
        member's while its lockstep group (``stalled_by`` members) has a core per member; a
        lockstep member's partners off the cores wait at their next meeting, so beside it only
        the cores' worth of ranks compute (``simulate``'s docstring)."""
        cores = self.cores
        on_cores = min(computing, cores) if stalled_by > 1 else computing
        if stalled_by > cores:
            exposed = 1.0     # a member waiting at a meeting yields its core to another member: never free
        slowed = 1.0 + (self.beside_waiting(on_cores) - 1.0) * exposed
        if computing > cores:
            share = cores / computing
            if stalled_by > cores:   # between two meetings some core runs ceil(members / cores) of them
                share *= stalled_by / (cores * math.ceil(stalled_by / cores))
            return share / slowed
        return 1.0 / slowed ** stalled_by
