"""InferSettings: everything ``infer`` is asked to do, built once at the edge and checked before any rank talks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ConfigError
from ..data.resolution import target_mpp
from ..data.task import Task
from ..models.spec import ModelFamily
from ..spatial.geometry import TileGrid
from .outputs import OutputSpec, parse_outputs
from .tile_map import MapMode

DTYPES = ("float32", "float64")
DEFAULT_BUDGET = 1 << 30          # bytes per rank for one window when --window is not given
OVERLAY_SIDE = 1600


@dataclass(frozen=True)
class InferSettings:
    """Everything ``infer`` is asked to do (the command's flags, ``dl.infer_slide``'s arguments)."""

    checkpoint: str
    slide: str
    outputs: tuple[str, ...]
    level: int | None = None               # --slide-level (None: level 0, or chosen by resolution)
    mpp: float | None = None               # --mpp: µm per pixel to run at (default: the checkpoint's)
    magnification: float | None = None     # --magnification: the same as MAGNIFICATION_MPP / M
    source_mpp: float | None = None        # --source-mpp: level 0's µm per pixel when the slide carries none
    num_spatial_parts: int = 1
    slice_method: str = "square"
    window: int | None = None
    dtype: str = "float32"
    tissue_only: bool = False
    min_tissue: float = 0.0
    batch_windows: int = 1
    resume: bool = False
    overwrite: bool = False
    output_stride: int | None = None
    heat_class: int | None = None
    model: ModelFamily | str | None = None
    task: Task | str | None = None         # --task: refuse a checkpoint of the other task
    threshold: float | None = None         # .geojson: least probability of a region's class (default below)
    min_area: float = 0.0                  # .geojson: regions and holes smaller than this (level-0 px²) dropped
    exclude_classes: tuple[str, ...] = ()  # .geojson: classes not traced (names or indices)
    max_window_rows: int | None = None
    memory_budget: int = DEFAULT_BUDGET
    overlay_side: int = OVERLAY_SIDE
    progress: bool = True
    keep_trace: bool = False
    cohort: bool = False                   # outputs are ``{slide}`` templates (``--slides``)
    map_mode: MapMode | str = MapMode.DENSE   # --map-mode: cells fully convolutional, or each tile alone
    stain_normalize: bool = True           # the checkpoint's stain normaliser, when it has one (--no-stain-normalize)

    def check(self) -> None:
        """Errors in the flags alone, naming the flag and what works."""
        if self.dtype not in DTYPES:
            raise ConfigError("--dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for flag, value, least in (("--batch-windows", self.batch_windows, 1), ("--slide-level", self.level, 0),
                                   ("--num-spatial-parts", self.num_spatial_parts, 1),
                                   ("--window", self.window, 1), ("--output-stride", self.output_stride, 1),
                                   ("--max-window-rows", self.max_window_rows, 1),
                                   ("--heat-class", self.heat_class, 0), ("--memory-budget", self.memory_budget, 1),
                                   ("--overlay-side", self.overlay_side, 16), ("--min-area", self.min_area, 0)):
            if value is not None and value < least:
                raise ConfigError(flag, f"must be >= {least}, got {value}")
        if not 0.0 <= self.min_tissue < 1.0:
            raise ConfigError("--min-tissue", f"must be in [0, 1), got {self.min_tissue}")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ConfigError("--threshold", f"must be a probability in [0, 1], got {self.threshold}")
        if self.source_mpp is not None and not self.source_mpp > 0:
            raise ConfigError("--source-mpp", f"must be > 0 (µm per pixel), got {self.source_mpp}")
        if self.task is not None:
            Task.parse(self.task)
        target_mpp(self.mpp, self.magnification)
        self.check_map_mode()
        TileGrid.from_slice_method(self.slice_method, self.num_spatial_parts)
        self.specs()

    def check_map_mode(self) -> None:
        """``--map-mode`` is one of its values; ``tiles`` runs whole slides only (no resume, stops, tissue skips)."""
        if self.map_mode not in MapMode.values():
            raise ConfigError("--map-mode", f"must be one of {', '.join(MapMode.values())}, got {self.map_mode!r}")
        if self.map_mode != MapMode.TILES:
            return
        for flag, given in (("--resume", self.resume), ("--max-window-rows", self.max_window_rows is not None),
                            ("--tissue-only", self.tissue_only)):
            if given:
                raise ConfigError("--map-mode", f"tiles runs the whole slide in one go; drop {flag}, or use "
                                                f"--map-mode dense")

    def specs(self) -> tuple[OutputSpec, ...]:
        """The ``--output`` values parsed (kinds of bare .tif outputs not yet resolved)."""
        return parse_outputs(self.outputs, self.cohort)

    @property
    def target_mpp(self) -> float | None:
        return target_mpp(self.mpp, self.magnification)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

