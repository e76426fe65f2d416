"""Notebook widgets (ipywidgets + matplotlib): config panel, halo viewer, step-through, timeline, learning curves."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:     # the widgets load on first use (ipywidgets is heavy); type checkers see them here
    from .autotune import AutoTune as AutoTune
    from .config_panel import ConfigPanel as ConfigPanel
    from .figure_view import FigureView as FigureView
    from .halo_viewer import HaloViewer as HaloViewer
    from .halo_viewer import windowed_layers as windowed_layers
    from .learning_curves import LearningCurves as LearningCurves
    from .stepper import ClusterStepAgent as ClusterStepAgent
    from .stepper import StepThrough as StepThrough
    from .timeline import TimelineView as TimelineView
    from .timeline import TrainingProgress as TrainingProgress
    from .volume_halo_viewer import VolumeHaloViewer as VolumeHaloViewer
    from .volume_halo_viewer import volume_layers as volume_layers

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
    "VolumeHaloViewer": "volume_halo_viewer",
    "volume_layers": "volume_halo_viewer",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mpi4dl_nb.notebook.widgets' has no attribute {name!r}")
