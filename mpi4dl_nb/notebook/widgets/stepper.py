"""StepThrough: advance a distributed training step one schedule action at a time.

Without an agent the widget walks the schedule alone (what would happen). With a
:class:`ClusterStepAgent` every forward click releases that action on its rank of the
running cluster (``HybridEngine.train_step(on_action=...)`` blocks before each action),
checks the engine holds exactly that action, and shows what happened: trace events
(halo exchanges, bytes, peers) and output shapes. Back/forward move the view; actions
already executed are not re-run.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import ipywidgets as w

from ...comm.trace import Event
from ...measure.usage import is_communication
from ...pipeline.actions import COMPUTE_KINDS, Action
from ...pipeline.schedules import Schedule
from .. import viz
from ..cluster import Cluster
from .figure_view import FigureView, display_widget
from .step_agent import StepReport, action_key


def _where(event: Event) -> str:
    """`` stage 0 micro_batch 1 layer 2 peer 3``: what an event is tied to (-1: no micro-batch)."""
    tied = {"stage": event.stage, "micro_batch": event.micro_batch, "layer": event.extra.get("layer"),
            "peer": event.peer}
    return "".join(f" {key} {value}" for key, value in tied.items() if value not in (None, "", -1))


def event_lines(events: Sequence[Event]) -> list[str]:
    """Trace events of one release as text; a forward/backward's time is split into its own compute and the
    time it waited inside for peers (halo exchanges, which finish only when the neighbour's action is released)."""
    comm = [e for e in events if is_communication(e.op)]
    lines = []
    for event in events:
        op = event.op
        total = event.end - event.start
        where = _where(event)
        moved = f", {event.bytes} bytes" if event.bytes else ""
        if op in COMPUTE_KINDS:
            inside = [(max(c.start, event.start), min(c.end, event.end)) for c in comm]
            waited = _covered([span for span in inside if span[1] > span[0]])
            lines.append(f"{op}{where}: compute {(total - waited) * 1e3:.1f} ms, waiting for peers "
                         f"{waited * 1e3:.1f} ms{moved}")
        else:
            kind = "communication incl. waiting" if is_communication(op) else "took"
            lines.append(f"{op}{where}: {kind} {total * 1e3:.1f} ms{moved}")
    return lines


def _covered(spans: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) spans."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total


class ClusterStepAgent:
    """Notebook side of the step agents: one per rank, on engine variables by name.

    ``engine``/``images``/``labels`` name variables in the engines' namespace (a
    HybridEngine and the global batch, as created by ``cluster.run``/``execute``).
    """

    def __init__(self, cluster: Cluster, engine: str = "eng", images: str = "images",
                 labels: str = "labels", settle: float = 2.0, timeout: float = 60.0) -> None:
        self.cluster = cluster
        self.names = (engine, images, labels)
        self.settle = settle
        self.timeout = timeout
        self.started = False

    def fetch_schedule(self) -> Schedule:
        """The engine's own Schedule object (from rank 0)."""
        from ipyparallel import Reference

        from .step_agent import _schedule_of

        return self.cluster.run_on([0], _schedule_of, Reference(self.names[0]),
                                   timeout=self.timeout)[0]

    def start(self) -> list[StepReport]:
        from ipyparallel import Reference

        from .step_agent import start_agent

        reports = self.cluster.run(start_agent, *(Reference(n) for n in self.names), self.settle,
                                   timeout=self.timeout)
        self.started = True
        return reports

    def release(self, action: Action, settle: float | None = None) -> StepReport:
        """Release ``action`` on its rank; wait up to ``settle`` s for it to get through."""
        from .step_agent import release_action

        return self.cluster.run_on([action.rank], release_action, action_key(action), settle,
                                   timeout=self.timeout)[0]

    def finish(self) -> list[StepReport]:
        from .step_agent import join_agent

        self.started = False
        return self.cluster.run(join_agent, self.timeout, timeout=self.timeout + 10)


class StepThrough:
    """Buttons back / forward / run to end / reset over ``schedule.global_order()``.

    State: ``position`` (actions shown as done), ``executed`` (actions released on the
    cluster), ``reports[i]`` (what rank reported after action ``i``), ``history`` (the
    executed actions in order), ``final`` (per-rank end reports, with the loss).
    """

    def __init__(self, schedule: Schedule, agent: ClusterStepAgent | None = None) -> None:
        self.schedule = schedule
        self.actions = schedule.global_order()
        self.agent = agent
        self.position = 0
        self.executed = 0
        self.reports: list[StepReport | None] = []
        self.history: list[Action] = []
        self.final: list[StepReport] | None = None
        self.error: str | None = None
        self.back_button = w.Button(description="◀ back")
        self.forward_button = w.Button(description="forward ▶")
        self.end_button = w.Button(description="run to end ▶▶")    # glyphs every DejaVu/Liberation font has
        self.reset_button = w.Button(description="reset view")
        self.back_button.on_click(lambda _: self.back())
        self.forward_button.on_click(lambda _: self.forward())
        self.end_button.on_click(lambda _: self.run_to_end())
        self.reset_button.on_click(lambda _: self.reset())
        self.label = w.HTML()
        self.details = w.HTML()
        self.view = FigureView()
        self.widget = w.VBox([w.HBox([self.back_button, self.forward_button, self.end_button,
                                      self.reset_button]), self.label, self.view.widget,
                              self.details])
        self.render()

    # ---------------------------------------------------------------- navigation
    @property
    def current(self) -> Action | None:
        return self.actions[self.position - 1] if self.position else None

    def forward(self, render: bool = True, settle: float | None = None) -> Action | None:
        """Show (and on the cluster, execute) the next action."""
        if self.position >= len(self.actions):
            return None
        action = self.actions[self.position]
        if self.position == self.executed:
            self._execute(action, settle)
        self.position += 1
        if render:
            self.render()
        return action

    def back(self) -> None:
        self.position = max(0, self.position - 1)
        self.render()

    def run_to_end(self) -> None:
        while self.position < len(self.actions):
            self.forward(render=False, settle=0.0)   # queue the rest; finish() waits
        self.render()

    def reset(self) -> None:
        self.position = 0
        self.render()

    def _execute(self, action: Action, settle: float | None = None) -> None:
        report = None
        if self.agent is not None:
            if not self.agent.started:
                self.agent.start()
            report = self.agent.release(action, settle)
            if report.mismatches:
                self.error = f"rank {report.rank} mismatches: {report.mismatches}"
        self.reports.append(report)
        self.history.append(action)
        self.executed += 1
        if self.agent is not None and self.executed == len(self.actions):
            self.final = self.agent.finish()
            bad = [r for r in self.final if r.mismatches or r.error]
            if bad:
                self.error = "; ".join(f"rank {r.rank}: {r.mismatches or r.error}" for r in bad)

    # -------------------------------------------------------------------- display
    @property
    def finished(self) -> bool:
        """Every action was released and every rank reported the end of the step."""
        return self.final is not None

    def render(self) -> None:
        self.view.show(viz.draw_schedule(self.schedule, self.position))
        self.label.value = f"<b>{html.escape(self.heading())}</b>"
        self.details.value = "<br>".join(
            f"<b style='color:#b00'>{html.escape(line)}</b>" if alarm else html.escape(line)
            for line, alarm in self._detail_lines())

    def heading(self) -> str:
        """Where the view is, as plain text: ``action 3/34 (executed on the cluster): <action>``."""
        state = "executed on the cluster" if self.agent is not None else "schedule only"
        current = self.current
        text = current.describe() if current else "press forward to start"
        cfg = self.schedule.cfg
        if current is not None and current.kind.is_compute and cfg.virtual_stages > 1:
            text += f", the rank's chunk {current.stage // cfg.pipeline_positions} of {cfg.virtual_stages}"
        return f"action {self.position}/{len(self.actions)} ({state}): {text}"

    def text(self) -> str:
        """Heading and details as plain text (what the widget shows, for ``print``)."""
        return "\n".join([self.heading(), *(f"    {line}" for line, _ in self._detail_lines())])

    def _detail_lines(self) -> list[tuple[str, bool]]:
        """(line, is_alarm) pairs: what the rank reported after the shown action, and the end of the step."""
        if not self.position:
            return []
        report = self.reports[self.position - 1] if self.position - 1 < len(self.reports) else None
        lines: list[tuple[str, bool]] = []
        at_end = self.finished and self.position == len(self.actions)
        if report is not None:
            if report.error:
                lines.append((f"error on rank {report.rank}: {report.error}", True))
            if report.mismatches:
                lines.append((f"rank {report.rank} ran a different action than the schedule: "
                              f"{report.mismatches}", True))
            if not report.settled and not at_end:
                lines.append((f"rank {report.rank} waits for peers (halo exchange, hand-off or collective); "
                              f"{report.queued} released action(s) queued there run as soon as the "
                              f"peers arrive", False))
            for name, shape in report.shapes:
                lines.append((f"{name} output shape {tuple(shape)}", False))
            lines += [(line, False) for line in event_lines(report.events)]
        if at_end:
            losses = sorted({r.loss for r in self.final or [] if r.loss is not None})
            lines.append((f"step finished on every rank, loss {losses}", False))
        return lines

    def _ipython_display_(self) -> None:  # pragma: no cover - display only
        display_widget(self.widget)
