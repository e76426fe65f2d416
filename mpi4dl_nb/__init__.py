"""mpi4dl-nb: exact hybrid spatial/layer/pipeline/GEMS/data parallel CNN training from Jupyter."""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .config import ConfigError, ParallelConfig
from .layout import RankRole, layout

__version__ = "0.1.0"

# Heavier pieces load on first use so `import mpi4dl_nb` needs neither MPI nor torch.
_LAZY = {
    "init": ("comm", "init"),
    "Context": ("comm", "Context"),
    "Group": ("comm", "Group"),
    "TileGrid": ("geometry", "TileGrid"),
    "spatialize": ("spatialize", "spatialize"),
    "scatter_tiles": ("tiles", "scatter_tiles"),
    "gather_tiles": ("tiles", "gather_tiles"),
    "HybridEngine": ("engine", "HybridEngine"),
    "Tracer": ("trace", "Tracer"),
}

__all__ = ["ConfigError", "ParallelConfig", "RankRole", "layout", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(import_module(f".{module}", __name__), attr)
        globals()[name] = value
        return value
    if name in ("cluster", "planner", "viz", "widgets", "models", "data"):
        return import_module(f".{name}", __name__)
    raise AttributeError(f"module 'mpi4dl_nb' has no attribute {name!r}")
