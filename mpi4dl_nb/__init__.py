"""mpi4dl-nb: exact hybrid spatial/layer/pipeline/GEMS/data parallel CNN training from Jupyter."""

from __future__ import annotations

import sys
from importlib import import_module
from types import ModuleType
from typing import Any

from .config import ParallelConfig
from .errors import ConfigError
from .layout import RankRole, layout

__version__ = "0.1.0"

# Heavier pieces load on first use so `import mpi4dl_nb` needs neither MPI nor torch.
# One sub-package is named like a public callable (`infer`, the package of `dl.infer`): _Facade below keeps
# the callable when that sub-package is imported (its modules are imported by their dotted names).
_LAZY: dict[str, tuple[str, str]] = {
    "init": ("comm.context", "init"),
    "Context": ("comm.context", "Context"),
    "Group": ("comm.context", "Group"),
    "Tracer": ("comm.trace", "Tracer"),
    "TileGrid": ("spatial.geometry", "TileGrid"),
    "spatialize": ("spatial.convert", "spatialize"),
    "reduce_tile_gradients": ("spatial.convert", "reduce_tile_gradients"),
    "scatter_tiles": ("spatial.tiles", "scatter_tiles"),
    "gather_tiles": ("spatial.tiles", "gather_tiles"),
    "HybridEngine": ("pipeline.engine", "HybridEngine"),
    "serial_reference": ("pipeline.reference", "serial_reference"),
    "infer": ("infer.api", "infer"),
    "infer_slide": ("infer.api", "infer_slide"),
    "infer_volume": ("infer.volume_api", "infer_volume"),
    "layer_list": ("models.cut", "layer_list"),
    "load_weights": ("models.weights", "load_weights"),
    "read_weights": ("models.weights", "read_weights"),
    "model_state_dict": ("infer.model", "model_state_dict"),
    "Trainer": ("run.trainer", "Trainer"),
    "TrainSettings": ("run.trainer", "TrainSettings"),
    "split_dataset": ("run.python_run", "split_dataset"),
    "train": ("run.job_run", "train"),
    "evaluate": ("run.evaluate", "evaluate"),
    "plot_learning_curves": ("notebook.curves", "plot_learning_curves"),
}

# Sub-modules reachable as attributes (``dl.planner.estimate(...)``, ``dl.cluster.start(...)``).
_MODULES: dict[str, str] = {
    "cluster": "notebook.cluster",
    "planner": "planner",
    "viz": "notebook.viz",
    "widgets": "notebook.widgets",
    "models": "models",
    "data": "data",
}

__all__ = ["ConfigError", "ParallelConfig", "RankRole", "layout", *_LAZY]


class _Facade(ModuleType):
    """The package's module: importing a sub-package named like a public callable (``mpi4dl_nb.infer``) leaves
    the callable (``dl.infer``) in place; ``from mpi4dl_nb.infer.api import ...`` reaches the sub-package."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _LAZY and isinstance(value, ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Facade


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(import_module(f".{module}", __name__), attr)
        globals()[name] = value
        return value
    if name in _MODULES:
        return import_module(f".{_MODULES[name]}", __name__)
    raise AttributeError(f"module 'mpi4dl_nb' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_MODULES})
