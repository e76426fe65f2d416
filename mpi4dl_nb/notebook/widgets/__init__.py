"""Notebook widgets (ipywidgets + matplotlib): config panel, halo viewer, step-through, timeline, learning curves."""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "FigureView": "figure_view",
    "ConfigPanel": "config_panel",
    "HaloViewer": "halo_viewer",
    "windowed_layers": "halo_viewer",
    "StepThrough": "stepper",
    "ClusterStepAgent": "stepper",
    "TimelineView": "timeline",
    "TrainingProgress": "timeline",
    "AutoTune": "autotune",
    "LearningCurves": "learning_curves",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mpi4dl_nb.notebook.widgets' has no attribute {name!r}")
