"""Notebook widgets (ipywidgets + matplotlib): config panel, halo viewer, step-through, timeline, learning curves."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:     # the widgets load on first use (ipywidgets is heavy); type checkers see them here
    from .attention_viewer import AttentionViewer as AttentionViewer
    from .autotune import AutoTune as AutoTune
    from .config_panel import ConfigPanel as ConfigPanel
    from .figure_view import FigureView as FigureView
    from .halo_viewer import HaloViewer as HaloViewer
    from .halo_viewer import WindowedLayer as WindowedLayer
    from .halo_viewer import windowed_layers as windowed_layers
    from .learning_curves import LearningCurves as LearningCurves
    from .stepper import ClusterStepAgent as ClusterStepAgent
    from .stepper import StepThrough as StepThrough
    from .timeline import TimelineView as TimelineView
    from .timeline import TrainingProgress as TrainingProgress
    from .window_viewer import WindowViewer as WindowViewer

_EXPORTS = {
    "FigureView": "figure_view",
    "ConfigPanel": "config_panel",
    "HaloViewer": "halo_viewer",
    "WindowedLayer": "halo_viewer",
    "windowed_layers": "halo_viewer",
    "StepThrough": "stepper",
    "ClusterStepAgent": "stepper",
    "TimelineView": "timeline",
    "TrainingProgress": "timeline",
    "AutoTune": "autotune",
    "AttentionViewer": "attention_viewer",
    "WindowViewer": "window_viewer",
    "LearningCurves": "learning_curves",
}
# names that are gone, and their new spelling (one halo viewer for images and volumes: the grid says which)
_RENAMED = {
    "VolumeHaloViewer": "HaloViewer(volume, layers, slice_method='2x2x2', depth_index=...)",
    "volume_layers": "windowed_layers(model, (depth, height, width))",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _RENAMED:   # ImportError, not AttributeError: ``from ... import`` shows this message then
        raise ImportError(f"mpi4dl_nb.notebook.widgets.{name} is now {_RENAMED[name]}")
    raise AttributeError(f"module 'mpi4dl_nb.notebook.widgets' has no attribute {name!r}")
