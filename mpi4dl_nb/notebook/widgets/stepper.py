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
from typing import Any

import ipywidgets as w

from ...pipeline.schedules import Action, Schedule
from .. import viz
from .figure_view import FigureView, display_widget
from .step_agent import action_key


class ClusterStepAgent:
    """Notebook side of the step agents: one per rank, on engine variables by name.

    ``engine``/``images``/``labels`` name variables in the engines' namespace (a
    HybridEngine and the global batch, as created by ``cluster.run``/``execute``).
    """

    def __init__(self, cluster: Any, engine: str = "eng", images: str = "images",
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

    def start(self) -> list[dict[str, Any]]:
        from ipyparallel import Reference

        from .step_agent import start_agent

        reports = self.cluster.run(start_agent, *(Reference(n) for n in self.names), self.settle,
                                   timeout=self.timeout)
        self.started = True
        return reports

    def release(self, action: Action, settle: float | None = None) -> dict[str, Any]:
        """Release ``action`` on its rank; wait up to ``settle`` s for it to get through."""
        from .step_agent import release_action

        return self.cluster.run_on([action.rank], release_action, action_key(action), settle,
                                   timeout=self.timeout)[0]

    def finish(self) -> list[dict[str, Any]]:
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
        self.reports: list[dict[str, Any] | None] = []
        self.history: list[Action] = []
        self.final: list[dict[str, Any]] | None = None
        self.error: str | None = None
        self.back_button = w.Button(description="◀ back")
        self.forward_button = w.Button(description="forward ▶")
        self.end_button = w.Button(description="run to end ⏭")
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
            if report.get("mismatches"):
                self.error = f"rank {report['rank']} mismatches: {report['mismatches']}"
        self.reports.append(report)
        self.history.append(action)
        self.executed += 1
        if self.agent is not None and self.executed == len(self.actions):
            self.final = self.agent.finish()
            bad = [r for r in self.final if r.get("mismatches") or r.get("error")]
            if bad:
                self.error = "; ".join(f"rank {r['rank']}: {r.get('mismatches') or r.get('error')}"
                                       for r in bad)

    # -------------------------------------------------------------------- display
    def render(self) -> None:
        self.view.show(viz.draw_schedule(self.schedule, self.position))
        state = "executed on the cluster" if self.agent is not None else "schedule only"
        current = self.current
        text = html.escape(current.describe()) if current else "press forward to start"
        self.label.value = (f"<b>action {self.position}/{len(self.actions)}</b> ({state}): "
                            f"{text}")
        self.details.value = self._details_html()

    def _details_html(self) -> str:
        if not self.position:
            return ""
        report = self.reports[self.position - 1] if self.position - 1 < len(self.reports) else None
        lines = []
        if report is not None:
            if report.get("error"):
                lines.append(f"<b style='color:#b00'>error on rank {report['rank']}: "
                             f"{html.escape(report['error'])}</b>")
            if report.get("mismatches"):
                lines.append(f"<b style='color:#b00'>rank {report['rank']} ran a different "
                             f"action than the schedule: {report['mismatches']}</b>")
            if not report.get("settled", True):
                lines.append(f"rank {report['rank']} waits for peers (halo exchange, "
                             f"hand-off or collective); {report.get('queued', 0)} released "
                             f"action(s) queued there run as soon as the peers arrive")
            for name, shape in report.get("shapes", []):
                lines.append(f"{html.escape(name)} output shape {shape}")
            for event in report.get("events", []):
                extra = f" {event['bytes']} bytes" if event.get("bytes") else ""
                peer = f" peer {event['peer']}" if event.get("peer") is not None else ""
                layer = f" layer {event['layer']}" if event.get("layer") else ""
                lines.append(f"event {html.escape(str(event['op']))}{layer}{peer}{extra} "
                             f"({(event['end'] - event['start']) * 1e3:.2f} ms)")
        if self.final is not None and self.position == len(self.actions):
            losses = {r["loss"] for r in self.final}
            lines.append(f"step finished on every rank, loss {sorted(losses)}")
        return "<br>".join(lines)

    def _ipython_display_(self) -> None:  # pragma: no cover - display only
        display_widget(self.widget)
