"""Engine-side step agent: runs one HybridEngine.train_step in a thread, one action per release.

Runs on every MPI rank (no widget imports). ``HybridEngine.train_step(on_action=...)`` calls
the gate before each of this rank's actions; the gate blocks until the notebook releases
exactly that action, so the notebook drives the real distributed step action by action.
Each release reports the trace events that finished since (the action's span, halo
exchanges inside it, bytes, peers) and the output shape of every layer and stage the rank
ran (layer by layer, in execution order).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...comm.trace import Event
from ...pipeline.actions import Action, ActionKind
from ...pipeline.schedules import Schedule

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from ...pipeline.engine import HybridEngine
    from ...pipeline.step_input import Images, Labels

ActionKey = tuple[ActionKind, int, int, int, int, int, int, "int | None"]
PLAIN = (int, str, float)     # the trace extras a report carries (what every process can unpickle)


@dataclass
class StepReport:
    """What one rank reports to the notebook after a release: the action it holds, what it ran, the
    trace events finished since the last report and the output shape of every layer and stage it ran."""

    rank: int
    waiting: ActionKey | None           # the action held at the gate (None: running, or done)
    queued: int                         # released actions not yet reached
    executed: list[ActionKey]
    mismatches: list[tuple[ActionKey, ActionKey]]   # (released, what the engine ran instead)
    running: bool
    finished: bool
    loss: float | None
    error: str | None
    events: list[Event] = field(default_factory=list)
    shapes: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    settled: bool = True                # the rank got to its next gate within the settle time


def action_key(action: Action) -> ActionKey:
    """What identifies an action across processes (Action is a frozen dataclass)."""
    return (action.kind, action.rank, action.tick, action.stage, action.micro_batch,
            action.replica, action.copy, action.peer)


class EngineStepAgent:
    """Drive ``engine.train_step(images, labels)`` one action at a time on this rank.

    Releases are queued: a rank still inside an action that waits for a peer (halo
    exchange, all-reduce) takes its next released action as soon as it gets there. Each
    action the engine reaches is compared with the released one; differences are kept in
    ``mismatches`` (the engine always runs its own order, so the job never hangs on it).
    """

    def __init__(self, engine: HybridEngine, images: Images, labels: Labels, settle: float = 2.0) -> None:
        self.engine = engine
        self.images = images
        self.labels = labels
        self.settle = settle
        self.waiting: Action | None = None   # the action held at the gate, None when running/done
        self.loss: float | None = None
        self.error: str | None = None
        self.executed: list[ActionKey] = []
        self.mismatches: list[tuple[ActionKey, ActionKey]] = []
        self._pending: deque[ActionKey] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._events_seen = 0
        self._shapes: list[tuple[str, tuple[int, ...]]] = []
        self._hooks: list[RemovableHandle] = []

    # ---------------------------------------------------------------- engine thread
    def _on_action(self, action: Action) -> None:
        key = action_key(action)
        with self._cond:
            self.waiting = action
            self._cond.notify_all()
            while not self._pending:
                self._cond.wait()
            expected = self._pending.popleft()
            if expected != key:
                self.mismatches.append((expected, key))
            self.executed.append(key)
            self.waiting = None
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            self.loss = self.engine.train_step(self.images, self.labels, on_action=self._on_action)
        except BaseException as exc:  # reported to the notebook by the next release
            import traceback

            self.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        finally:
            with self._cond:
                self.waiting = None
                self._cond.notify_all()

    @property
    def _running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _wait_settled(self, timeout: float) -> bool:
        """Wait until every released action started and the thread sits at a gate (or ended)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._running and (self._pending or self.waiting is None):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.05))
        return True

    def _shape_hook(self, name: str) -> Callable[[nn.Module, tuple[object, ...], object], None]:
        def hook(module: nn.Module, inputs: tuple[object, ...], output: object) -> None:
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for out in outs:
                if isinstance(out, torch.Tensor):
                    self._shapes.append((name, tuple(out.shape)))
        return hook

    # ------------------------------------------------------------------ notebook side
    def start(self) -> StepReport:
        """Start the step thread; returns the report with the first action it holds."""
        for (replica, stage), module in self.engine.local_modules().items():
            label = f"stage {stage}{' mirror' if replica else ''}"
            for index, layer in enumerate(module.children()):      # layer by layer
                name = f"{label} layer {index} ({type(layer).__name__})"
                self._hooks.append(layer.register_forward_hook(self._shape_hook(name)))
            self._hooks.append(module.register_forward_hook(self._shape_hook(label)))
        self.engine.ctx.tracer.enabled = True
        self._events_seen = self.engine.ctx.tracer.recorded
        self._thread = threading.Thread(target=self._run, name="mpi4dl-step", daemon=True)
        self._thread.start()
        self._wait_settled(self.settle)
        return self.report()

    def release(self, expected: ActionKey, settle: float | None = None) -> StepReport:
        """Queue the next action (``action_key``) and let the rank run up to the one after
        (waiting at most ``settle`` seconds, default the agent's)."""
        if not self._running:
            raise RuntimeError(f"rank {self.engine.ctx.rank} has no step running "
                               f"(finished: loss={self.loss}, error={self.error})")
        with self._cond:
            self._pending.append(expected)
            self._cond.notify_all()
        settled = self._wait_settled(self.settle if settle is None else settle)
        return replace(self.report(), settled=settled)

    def report(self) -> StepReport:
        """Status of this rank: held action, new trace events and output shapes since last."""
        tracer = self.engine.ctx.tracer
        new = tracer.since(self._events_seen)   # the trace is a bounded window: count, not index
        self._events_seen = tracer.recorded
        shapes, self._shapes = self._shapes, []
        running = self._running
        return StepReport(
            rank=self.engine.ctx.rank,
            waiting=action_key(self.waiting) if self.waiting is not None else None,
            queued=len(self._pending), executed=list(self.executed), mismatches=list(self.mismatches),
            running=running, finished=self._thread is not None and not running, loss=self.loss, error=self.error,
            events=[replace(e, extra={k: v for k, v in e.extra.items() if isinstance(v, PLAIN)}) for e in new],
            shapes=shapes)

    def join(self, timeout: float = 60.0) -> StepReport:
        """Wait for the step to end (after every action was released); remove hooks."""
        if self._thread is not None:
            self._thread.join(timeout)
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        return self.report()


# Module-level entry points for ipyparallel (Reference arguments resolve on the engine);
# the engine process keeps its one current agent here.
_CURRENT: list[EngineStepAgent] = []


def start_agent(engine: HybridEngine, images: Images, labels: Labels, settle: float = 2.0) -> StepReport:
    """Create and start this engine's agent (replacing a finished one)."""
    if _CURRENT and _CURRENT[0]._running:
        raise RuntimeError("a step-through is still running on this engine; release its "
                           "remaining actions (run to end) or restart the cluster")
    agent = EngineStepAgent(engine, images, labels, settle)
    _CURRENT[:] = [agent]
    return agent.start()


def _agent() -> EngineStepAgent:
    agent = _CURRENT[0] if _CURRENT else None
    if agent is None:
        raise RuntimeError("no step agent on this engine; call ClusterStepAgent.start() first")
    return agent


def release_action(expected: ActionKey, settle: float | None = None) -> StepReport:
    return _agent().release(expected, settle)


def join_agent(timeout: float = 60.0) -> StepReport:
    return _agent().join(timeout)


def _schedule_of(engine: HybridEngine) -> Schedule:
    """The Schedule a HybridEngine executes."""
    return engine.schedule
