"""Replay a Schedule in simulated time: actions, messages, collectives, shared cores (docs/planner-models.md)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from ..pipeline.actions import Action
from ..pipeline.schedules import Schedule
from .crowding import SharedCores

EPS = 1e-12


@dataclass(frozen=True)
class Cost:
    """What one action costs its rank: ``work`` on a core, then ``delay`` of wire time.

    ``group``: a key shared by the ``members`` actions that run together on several ranks
    (the tiles of one spatial op, an all-reduce); None for a rank's own action. ``crowded``:
    added to ``delay`` in proportion to the share of ``work`` done while more ranks compute
    than there are cores (the members' meetings - halo exchanges, BatchNorm sums - spread
    over the work then find ranks descheduled), as measured with every rank computing; fewer
    ranks beyond the cores pay proportionally less (``_ScheduleReplay.crowding``). ``lockstep`` and
    ``exposed``: how waiting ranks' wake-ups slow the action (module docstring).
    """

    work: float = 0.0
    delay: float = 0.0
    group: Hashable = None
    members: int = 1
    crowded: float = 0.0      # extra delay when the group starts while ranks outnumber the cores
    lockstep: bool = False    # the members meet often: a wake-up on one member's core stalls them all
    exposed: float = 1.0      # share of the action's time its rank computes (the rest: waiting at meetings)


@dataclass
class RankTimeline:
    """One rank's simulated step: end time and where its time went (seconds)."""

    rank: int
    end: float = 0.0
    compute: float = 0.0      # running actions (slowed down when ranks share cores)
    wire: float = 0.0         # fixed delays: halo and collective wire time
    waiting: float = 0.0      # idle until the step's end: bubbles, messages, other ranks
    spans: list[tuple[float, float, str]] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)   # action kind -> seconds, as a trace shows them

    def add_phase(self, kind: str, seconds: float) -> None:
        self.phases[kind] = self.phases.get(kind, 0.0) + seconds


@dataclass
class _Running:
    rank: int
    action: Action
    remaining: float
    delay: float
    group: Hashable
    start: float
    crowded_per_work: float = 0.0     # extra delay per second of work done while cores are crowded
    stalled_by: int = 1               # members whose interruptions stall this one (lockstep groups)
    exposed: float = 1.0              # share of its time exposed to waiting ranks' wake-ups


class _ScheduleReplay:
    """State of one simulated step (see ``simulate``)."""

    def __init__(self, schedule: Schedule, cost: Callable[[Action], Cost],
                 message: Callable[[Action], float], cores: int | None,
                 start: Callable[[int], float] | None = None, waiting_slowdown: float = 1.0) -> None:
        self.lists = [schedule.actions(r) for r in range(len(schedule.per_rank))]
        self.cost, self.message = cost, message
        count = len(self.lists)
        self.sharing = SharedCores(cores, count, waiting_slowdown) if cores is not None else None
        self.position = [0] * count
        self.free_at = [start(r) if start is not None else 0.0 for r in range(count)]
        self.timelines = [RankTimeline(r, compute=t, spans=[(0.0, t, "setup")] if t else [])
                          for r, t in enumerate(self.free_at)]
        self.arrivals: dict[tuple[int | None, int | None, int], list[float]] = {}   # (from, to, tag)
        self.taken: dict[tuple[int | None, int | None, int], int] = {}
        self.gathering: dict[Hashable, dict[int, Action]] = {}
        self.finishing: dict[Hashable, list[_Running]] = {}
        self.running: dict[int, _Running] = {}
        self.blocked: set[int] = set()
        self.now = 0.0
        self.last_done = list(self.free_at)   # when each rank's previous action ended (its phases tile the step)

    def done(self) -> bool:
        return (all(p >= len(lst) for p, lst in zip(self.position, self.lists))
                and not self.running and not self.blocked)

    def wait(self, rank: int, until: float) -> None:
        self.free_at[rank] = until

    def try_start(self, rank: int) -> bool:
        if (self.position[rank] >= len(self.lists[rank]) or rank in self.running
                or rank in self.blocked or self.free_at[rank] > self.now + EPS):
            return False
        action = self.lists[rank][self.position[rank]]
        kind = action.kind
        if kind.is_p2p and kind.is_send:
            work = self.cost(action).work
            if work > EPS:                         # the sender's own work, then the message leaves
                self.running[rank] = _Running(rank, action, work, 0.0, None, self.now)
                return True
            self.send(action)
            self.completed(rank, kind.value, self.now)
            return True
        if kind.is_p2p:
            key = (action.peer, rank, action.tag)
            index = self.taken.get(key, 0)
            sent = self.arrivals.get((action.peer, rank, action.tag), [])
            if index >= len(sent):
                return False                       # not sent yet: an event will wake us
            if sent[index] > self.now + EPS:
                self.wait(rank, sent[index])
                return False
            self.taken[key] = index + 1
            work = self.cost(action).work
            if work > EPS:                         # the receiver's own work on the payload
                self.running[rank] = _Running(rank, action, work, 0.0, None, self.now)
                return True
            self.completed(rank, kind.value, self.now)
            return True
        c = self.cost(action)
        if c.group is None or c.members <= 1:
            self.running[rank] = _Running(rank, action, c.work, c.delay, None, self.now)
            return True
        members = self.gathering.setdefault(c.group, {})
        members[rank] = action
        self.blocked.add(rank)
        self.timelines[rank].spans.append((self.now, self.now, "gather"))
        if len(members) == c.members:
            for member, act in members.items():
                mc = self.cost(act)
                self.blocked.discard(member)
                self.timelines[member].spans.pop()
                self.running[member] = _Running(member, act, mc.work, mc.delay, c.group, self.now,
                                                mc.crowded / mc.work if mc.work > EPS else 0.0,
                                                mc.members if mc.lockstep else 1, mc.exposed)
            del self.gathering[c.group]
        return True

    def send(self, action: Action) -> None:
        """``action``'s message leaves now: it arrives ``message(action)`` later."""
        self.arrivals.setdefault((action.rank, action.peer, action.tag), []).append(
            self.now + self.message(action))

    def finish(self, run: _Running) -> None:
        if run.action.kind.is_p2p and run.action.kind.is_send:
            self.send(run.action)
        timeline = self.timelines[run.rank]
        timeline.compute += self.now - run.start
        timeline.wire += run.delay
        timeline.spans.append((run.start, self.now, run.action.kind.value))
        self.free_at[run.rank] = self.now + run.delay
        self.completed(run.rank, run.action.kind.value, self.now + run.delay)

    def completed(self, rank: int, kind: str, at: float) -> None:
        """``rank``'s current action of ``kind`` ends ``at``: its phase runs from the end of the
        rank's previous action (waits for partners and messages included, as a trace shows them)."""
        self.timelines[rank].add_phase(kind, at - self.last_done[rank])
        self.last_done[rank] = at
        self.position[rank] += 1

    def crowding(self, demand: float) -> float:
        """How crowded the cores are (``SharedCores.crowding``; a device each: never)."""
        return self.sharing.crowding(demand) if self.sharing is not None else 0.0

    @staticmethod
    def core_demand(computing: Sequence[_Running]) -> float:
        """Cores' worth of the running actions: a lockstep member only its exposed share (the rest
        of its time it waits at meetings, its core free for another rank), any other a whole core."""
        return sum(r.exposed if r.stalled_by > 1 else 1.0 for r in computing)

    def rate(self, run: _Running, computing: int) -> float:
        """Share of full speed ``run`` computes at while ``computing`` ranks run (``SharedCores.rate``;
        a device each: full speed)."""
        if self.sharing is None:
            return 1.0
        return self.sharing.rate(computing, run.stalled_by, run.exposed)

    def advance(self) -> None:
        computing = list(self.running.values())
        rates = {r.rank: self.rate(r, len(computing)) for r in computing}
        events = [self.now + r.remaining / rates[r.rank] for r in computing]
        events += [t for t in self.free_at if t > self.now + EPS]
        events += [a for key, times in self.arrivals.items() for a in times[self.taken.get(key, 0):]
                   if a > self.now + EPS]
        if not events:
            stuck = [self.lists[r][self.position[r]].describe() for r in range(len(self.lists))
                     if self.position[r] < len(self.lists[r])]
            raise RuntimeError(f"simulated schedule stalled at {self.now:.6f} s: {stuck[:4]}")
        step_to = max(self.now, min(events))
        crowding = self.crowding(self.core_demand(computing))
        for r in computing:
            done = (step_to - self.now) * rates[r.rank]
            r.remaining -= done
            if crowding:      # the meetings of this share of the work found ranks descheduled
                r.delay += done * r.crowded_per_work * crowding
        self.now = step_to
        for run in [r for r in computing if r.remaining <= EPS]:
            del self.running[run.rank]
            if run.group is None:
                self.finish(run)
                continue
            group = self.finishing.setdefault(run.group, [])
            group.append(run)
            self.blocked.add(run.rank)
            if len(group) == self.cost(run.action).members:
                for member in group:
                    self.blocked.discard(member.rank)
                    self.finish(member)
                del self.finishing[run.group]

    def run(self) -> list[RankTimeline]:
        while True:
            progressed = True
            while progressed:
                progressed = False
                for rank in range(len(self.lists)):
                    while self.try_start(rank):
                        progressed = True
            if self.done():
                break
            self.advance()
        end = max(self.free_at, default=0.0)
        for timeline in self.timelines:
            timeline.end = self.free_at[timeline.rank]
            timeline.waiting = max(0.0, end - timeline.compute - timeline.wire)
        return self.timelines


def simulate(schedule: Schedule, cost: Callable[[Action], Cost], message: Callable[[Action], float],
             cores: int | None = None, start: Callable[[int], float] | None = None,
             waiting_slowdown: float = 1.0) -> list[RankTimeline]:
    """Simulated step of ``schedule``: ``cost(action)`` of compute and collective actions,
    ``message(send)`` the seconds from a send to its arrival, ``cores`` shared by all ranks
    (None: a device each), ``start(rank)`` the seconds before a rank's first action (setting
    the step up; default 0), ``waiting_slowdown`` how much slower the ranks filling the cores
    compute while the rest wait (``crowding.Crowding.waiting_slowdown``; fewer waiting: proportionally less).
    Returns every rank's timeline."""
    return _ScheduleReplay(schedule, cost, message, cores, start, waiting_slowdown).run()


def group_key(action: Action, ranks: Sequence[int], what: str) -> tuple[Hashable, ...]:
    """The key shared by the ranks ``ranks`` running ``action`` together."""
    return (what, action.kind.value, action.dp, action.replica, action.stage, action.micro_batch,
            action.copy, tuple(ranks))
