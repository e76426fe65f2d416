"""ConfigPanel: the MPI4DL knobs with live validation, rank layout, world size and per-rank memory."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import ipywidgets as w
from torch import nn

from ... import planner
from ...config import SCHEDULES, SLICE_METHODS, ConfigError, ParallelConfig, parse_balance
from .. import viz
from .figure_view import FigureView, display_widget

INT_KNOBS = ("split_size", "spatial_size", "num_spatial_parts", "parts", "times", "local_dp",
             "data_parallel")
CHOICE_KNOBS = {"slice_method": SLICE_METHODS, "schedule": SCHEDULES}
DESCRIPTION_WIDTH = "125px"


def balance_text(balance: object) -> str:
    """``(4, 1)`` -> ``"4,1"``; None -> ``""`` (the default cut: by memory with spatial stages, else even);
    text stays as it is; ConfigError naming ``balance`` for anything else."""
    if balance is None or isinstance(balance, str):
        return balance or ""
    if isinstance(balance, Iterable):
        return ",".join(str(int(b)) for b in balance)
    raise ConfigError("balance", f"{balance!r} is not a list of layer counts per stage, e.g. (4, 1)")


CONTROL_WIDTH = "235px"


class ConfigPanel:
    """Edit a ParallelConfig; every change re-validates and redraws.

    ``model`` (a layer list) enables the per-rank memory estimate (planner) and the
    layer-count checks; ``devices`` flags layouts that need more ranks than you have.
    State after each change: ``config`` (valid ParallelConfig or None), ``error`` (the
    message, or None), ``plan`` (planner.MemoryPlan or None), ``layout_view.figure``,
    ``memory_view.figure``.
    """

    def __init__(self, cfg: ParallelConfig | None = None, *, model: Sequence[nn.Module] | None = None,
                 image_size: int = 256, batch_size: int = 1, devices: int | None = None,
                 optimizer_states: int = 1) -> None:
        cfg = cfg or ParallelConfig()
        self.model = list(model) if model is not None else None
        self.devices = devices
        self.optimizer_states = optimizer_states
        self._profiles: dict[int, list[planner.LayerProfile]] = {}
        self._listeners: list[Callable[[ParallelConfig | None], None]] = []
        self.controls: dict[str, w.ValueWidget] = {}
        style = {"description_width": DESCRIPTION_WIDTH}       # room for the longest knob name, never cut
        for knob in INT_KNOBS:
            self.controls[knob] = w.BoundedIntText(value=getattr(cfg, knob), min=0, max=4096, description=knob,
                                                   style=style, layout=w.Layout(width=CONTROL_WIDTH))
        for knob, options in CHOICE_KNOBS.items():
            self.controls[knob] = w.Dropdown(options=options, value=str(getattr(cfg, knob)), description=knob,
                                             style=style, layout=w.Layout(width=CONTROL_WIDTH))
        self.controls["image_size"] = w.BoundedIntText(value=image_size, min=1, max=1 << 20, description="image_size",
                                                       style=style, layout=w.Layout(width=CONTROL_WIDTH))
        self.controls["batch_size"] = w.BoundedIntText(value=batch_size, min=1, max=1 << 16, description="batch_size",
                                                       style=style, layout=w.Layout(width=CONTROL_WIDTH))
        self.controls["balance"] = w.Text(value=balance_text(cfg.balance), description="balance",
                                          placeholder="default", style=style,
                                          layout=w.Layout(width=CONTROL_WIDTH))
        self.controls["halo_d2"] = w.Checkbox(value=cfg.halo_d2, description="halo_d2", indent=False,
                                              layout=w.Layout(width=CONTROL_WIDTH))
        self.status = w.HTML()
        self.world = w.HTML()
        self.layout_view = FigureView()
        self.memory_view = FigureView()
        # the per-rank breakdown can be long: it scrolls, so controls and figures stay on one screen
        self.memory_table = w.HTML(layout=w.Layout(max_height="110px", max_width="560px", overflow="auto"))
        self.config: ParallelConfig | None = None
        self.error: str | None = None
        self.plan: planner.MemoryPlan | None = None
        self._quiet = False
        for control in self.controls.values():
            control.observe(self._changed, names="value")
        knobs = list(self.controls.values())
        self.widget = w.VBox([
            w.HBox([w.VBox(knobs[:6]), w.VBox(knobs[6:10]), w.VBox(knobs[10:])]),
            self.status, self.world,
            w.HBox([self.layout_view.widget, w.VBox([self.memory_view.widget, self.memory_table])],
                   layout=w.Layout(flex_flow="row wrap", align_items="flex-start")),
        ])
        self.update()

    # ------------------------------------------------------------------ values
    @property
    def values(self) -> dict[str, object]:
        return {name: control.value for name, control in self.controls.items()}

    def set(self, **knobs: object) -> None:
        """Set several knobs at once (one validation at the end), as a user would."""
        unknown = set(knobs) - set(self.controls)
        if unknown:
            raise ValueError(f"unknown knob(s) {sorted(unknown)}; use {sorted(self.controls)}")
        self._quiet = True
        try:
            for name, value in knobs.items():
                self.controls[name].value = balance_text(value) if name == "balance" else value
        finally:
            self._quiet = False
        self.update()

    def on_change(self, callback: Callable[[ParallelConfig | None], None]) -> None:
        """Call ``callback(config_or_None)`` after each validation."""
        self._listeners.append(callback)

    def _changed(self, change: Mapping[str, object]) -> None:
        if not self._quiet:
            self.update()

    # ------------------------------------------------------------------ update
    def _profiles_for(self, image_size: int) -> list[planner.LayerProfile]:
        assert self.model is not None, "memory estimates need the panel's model"
        if image_size not in self._profiles:
            self._profiles[image_size] = planner.profile_layers(self.model, image_size)
        return self._profiles[image_size]

    def validate(self) -> ParallelConfig:
        """The current knobs as a checked ParallelConfig; raises ConfigError naming the knob."""
        image_size: int = self.controls["image_size"].value
        batch_size: int = self.controls["batch_size"].value
        knobs = {name: value for name, value in self.values.items() if name not in ("image_size", "batch_size")}
        knobs["balance"] = parse_balance(self.controls["balance"].value)
        cfg = ParallelConfig().with_(**knobs)
        cfg.validate(batch_size=batch_size, image_size=image_size,
                     num_layers=len(self.model) if self.model is not None else None)
        if self.devices is not None and cfg.world_size > self.devices:
            raise ConfigError("world_size", f"needs {cfg.world_size} ranks "
                              f"({cfg.describe_world()}) but only {self.devices} devices are "
                              f"available; lower num_spatial_parts, local_dp or data_parallel")
        return cfg

    def update(self) -> None:
        """Validate, then redraw layout and memory (or show the error)."""
        try:
            cfg = self.validate()
        except (ConfigError, ValueError) as exc:
            self.config, self.error, self.plan = None, str(exc), None
            self.status.value = f"<b style='color:#b00'>&#10007; {_escape(str(exc))}</b>"
            self._clear_results()
            for listener in self._listeners:
                listener(None)
            return
        self.config, self.error = cfg, None
        self.status.value = "<b style='color:#070'>&#10003; valid configuration</b>"
        self.world.value = (f"world size <b>{cfg.world_size}</b> = {_escape(cfg.describe_world())}"
                            f" &nbsp; (<code>mpiexec -n {cfg.world_size}</code>)")
        self.layout_view.show(viz.draw_rank_layout(cfg))
        self.plan = None
        if self.model is not None:
            image_size, batch = self.controls["image_size"].value, self.controls["batch_size"].value
            self.plan = planner.estimate_memory(self._profiles_for(image_size), cfg, image_size,
                                                batch, optimizer_states=self.optimizer_states)
            self.memory_view.show(viz.draw_memory_bars(estimate=self.plan.totals))
            self.memory_table.value = f'<pre style="white-space: pre; margin: 0">{_escape(self.plan.table())}</pre>'
        for listener in self._listeners:
            listener(cfg)

    def _clear_results(self) -> None:
        """Remove world size, layout, memory chart and table: they showed the last valid settings, not these."""
        self.world.value = ""
        self.layout_view.clear()
        self.memory_view.clear()
        self.memory_table.value = ""

    def _ipython_display_(self) -> None:  # pragma: no cover - display only
        display_widget(self.widget)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
