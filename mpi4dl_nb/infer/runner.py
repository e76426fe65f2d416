"""The streaming loop of slide inference: set-up agreed by every rank, then window rows of spatial forwards.

Every rank of the window grid reads only its own box of each window (a prefetch thread reads
the next while the current one computes), runs the spatialized fully convolutional network
(halo exchanges between the ranks of the window), and sends rank 0 its part of the window's
core; rank 0 writes it into the probability array and, after each window row, records that
the rows above are final (``--resume`` continues from there).
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO, TypeVar

import numpy as np
import torch
from torch import nn

from ..comm.trace import TraceValue
from ..config import ConfigError
from ..data.resolution import target_mpp
from ..data.task import Task
from ..measure.heap import PeakMeter, state_bytes
from ..models.spec import ModelFamily
from ..spatial.geometry import Box, TileGrid
from .finish import CLASSIFIER_THRESHOLD, OutputReport, OutputRequest, write_outputs
from .fully_conv import FullyConvolutional, measure_field
from .model import ModelDescription
from .outputs import OutputKind, OutputSpec, check_outputs, npy_base, parse_outputs
from .placement import CellPlacement
from .reader import Prefetcher, SlideReader
from .store import Fingerprint, HeatmapStore, load_progress, progress_path, save_progress, work_path
from .tissue import OVERVIEW_SIDE, TissueMap
from .trained import TrainedNetwork, load_network
from .windows import AxisField, Window, WindowPlan, batches, intersect, padded_extent, round_up

if TYPE_CHECKING:
    from ..comm.protocol import Comm

DTYPES = ("float32", "float64")
DEFAULT_BUDGET = 1 << 30          # bytes per rank for one window when --window is not given
OVERLAY_SIDE = 1600
CACHE_WINDOWS = 2                 # OpenSlide's tile cache holds this many of a rank's window boxes
T = TypeVar("T")


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
        TileGrid.from_slice_method(self.slice_method, self.num_spatial_parts)
        self.specs()

    def specs(self) -> tuple[OutputSpec, ...]:
        """The ``--output`` values parsed (kinds of bare .tif outputs not yet resolved)."""
        return parse_outputs(self.outputs, self.cohort)

    @property
    def target_mpp(self) -> float | None:
        return target_mpp(self.mpp, self.magnification)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


class SetupFailed(ValueError):
    """A rank refused the run during set-up; every rank raises it with the same message."""


def agreed(ctx: Comm, build: Callable[[], T]) -> T:
    """``build()`` on this rank; if it failed on any rank, raise SetupFailed everywhere (first failure's text)."""
    built: list[T] = []
    error: str | None = None
    try:
        built.append(build())
    except Exception as err:   # any failure: the other ranks must not wait for this one
        error = str(err) if isinstance(err, (ValueError, OSError)) else f"{type(err).__name__}: {err}"
    messages = ctx.all_gather_object(error)
    failed = [(rank, text) for rank, text in enumerate(messages) if text is not None]
    if failed:
        rank, text = failed[0]
        everywhere = len(failed) == len(messages) and len({t for _, t in failed}) == 1
        raise SetupFailed(text if everywhere or ctx.world_size == 1 else f"(rank {rank}) {text}")
    return built[0]


def check_halos(net: nn.Module, grid: TileGrid, sizes: Sequence[tuple[int, int]], channels: int = 3) -> None:
    """Refuse, before any window runs, window sizes whose tiles are thinner than some layer's halo."""
    from ..spatial.fit import halo_checked

    with halo_checked(net, grid) as probe:
        dtype = next((p.dtype for p in probe.parameters()), torch.float32)
        try:
            for height, width in sorted(sizes):
                with torch.no_grad():
                    probe(torch.empty(1, channels, height, width, device="meta", dtype=dtype))
        except ConfigError as err:
            raise ConfigError("--window", f"{err.detail} -- a window is split over {grid.rows} x {grid.cols} "
                              f"ranks; give each a larger --window or use fewer --num-spatial-parts") from err


def output_size(net: nn.Module, height: int, width: int, channels: int = 3) -> tuple[int, int]:
    """The network's output cells for an input of ``height x width`` (meta device)."""
    probe = copy.deepcopy(net).to("meta")
    dtype = next((p.dtype for p in probe.parameters()), torch.float32)
    with torch.no_grad():
        out = probe(torch.empty(1, channels, height, width, device="meta", dtype=dtype))
    return int(out.shape[-2]), int(out.shape[-1])


def default_window(net: FullyConvolutional, fields: tuple[AxisField, AxisField], grid: TileGrid,
                   budget: int, dtype: torch.dtype, slide: tuple[int, int]) -> int:
    """Pixels per rank per window so one window's forward stays within ``budget`` bytes per rank.

    Measures the heap peak of one serial forward on a small probe (bytes per input pixel,
    overestimated by fixed costs: safe), then takes the largest square window in budget;
    at least the smallest useful window, at most what covers the slide.
    """
    unit = max(f.unit for f in fields)
    side = round_up(max(256, 2 * net.shape.min_side), unit)
    meter = PeakMeter(torch.device("cpu"))
    meter.watch(net.modules())
    x = torch.rand(1, 3, side, side, dtype=dtype)
    meter.start()
    with torch.no_grad():
        net(x)
    meter.sample()
    meter.unwatch()
    per_pixel = max(meter.peak, 1) / (side * side) if meter.source != "none" else 64 * dtype.itemsize
    window = int(math.sqrt(budget / per_pixel)) // unit * unit
    smallest = max(-(-f.min_input() // p) for f, p in zip(fields, (grid.rows, grid.cols)))
    largest = max(-(-s // p) for s, p in zip(slide, (grid.rows, grid.cols)))
    largest = max(largest, *(f.min_input() for f in fields))
    return int(min(max(window, round_up(smallest, unit)), round_up(largest, unit)))


# --------------------------------------------------------------------------- set-up
@dataclass
class Plan:
    """Rank 0's decisions, sent to every rank: the window plan, skipped windows, resume point, outputs."""

    plan: WindowPlan
    skipped: set[tuple[int, int]]
    rows_done: int
    fingerprint: Fingerprint
    out_shape: tuple[int, int, int]
    fields: tuple[AxisField, AxisField]
    window: int
    outputs: tuple[OutputSpec, ...]


def fingerprint(settings: InferSettings, description: ModelDescription, reader: SlideReader,
                net: FullyConvolutional) -> Fingerprint:
    """What a partial output must share with this run to be resumed."""
    checkpoint = Path(description.path)
    return {"checkpoint": str(checkpoint.resolve()), "checkpoint_bytes": checkpoint.stat().st_size,
            "checkpoint_step": description.step, "slide": str(reader.path.resolve()), "level": reader.level,
            "scale": reader.choice.scale, "slide_size": [reader.height, reader.width], "stride": net.shape.stride,
            "dtype": settings.dtype, "tissue_only": settings.tissue_only, "min_tissue": settings.min_tissue}


def resolve_outputs(settings: InferSettings, trained: TrainedNetwork) -> tuple[OutputSpec, ...]:
    """The outputs with their kinds settled by the task; what a task cannot give is refused."""
    dense = trained.task is Task.SEGMENTATION
    specs = tuple(spec.resolved(dense) for spec in settings.specs())
    for spec in specs:
        if spec.kind is OutputKind.CSV and dense:
            raise ConfigError("--output", f"{spec.path}: a .csv has one row per output cell, here per pixel of the "
                                          f"slide; write the label map (.tif), the regions (.geojson) or the "
                                          f"probabilities (.npy) instead")
    if settings.heat_class is not None and settings.heat_class >= trained.net.shape.classes:
        raise ConfigError("--heat-class", f"the network has {trained.net.shape.classes} classes; use "
                                          f"0..{trained.net.shape.classes - 1}")
    class_indices(settings.exclude_classes, trained.classes)
    return specs


def class_indices(names: Sequence[str], classes: Sequence[str]) -> list[int]:
    """``--exclude-class`` values (names, or indices) as class indices."""
    found = []
    for name in names:
        if name in classes:
            found.append(list(classes).index(name))
        elif name.isdigit() and int(name) < len(classes):
            found.append(int(name))
        else:
            raise ConfigError("--exclude-class", f"{name!r} is not a class of this network ({', '.join(classes)})")
    return found


def decide(settings: InferSettings, trained: TrainedNetwork, reader: SlideReader, grid: TileGrid) -> Plan:
    """Rank 0: field, window, plan, resume point and background windows (collective errors via ``agreed``)."""
    net = trained.net
    specs = resolve_outputs(settings, trained)
    fields = measure_field(net)
    height, width = padded_extent(reader.height, fields[0].unit), padded_extent(reader.width, fields[1].unit)
    if min(height, width) < net.shape.min_side:
        raise ConfigError("--slide", f"{reader.path} level {reader.level} is {reader.width}x{reader.height} px, "
                          f"smaller than one output cell's patch ({net.shape.min_side} px); use a finer level")
    out_h, out_w = output_size(net, height, width)
    out_shape = (net.shape.classes, out_h, out_w)
    stamp = fingerprint(settings, trained.description, reader, net)
    work = work_path(npy_base(specs))
    progress = load_progress(progress_path(work))
    rows_done = 0
    if settings.resume:
        if progress is not None and work.is_file():
            if progress.fingerprint != stamp:
                changed = [k for k in stamp if progress.fingerprint.get(k) != stamp[k]]
                raise ConfigError("--resume", f"the partial output {work} was made with other {', '.join(changed)}; "
                                  f"rerun with the same checkpoint, slide and options, or drop --resume "
                                  f"and pass --overwrite")
            rows_done = progress.rows_done
        check_outputs([p for p in specs if p.path != work], settings.overwrite)
    else:
        if work.exists() and not settings.overwrite:
            raise ConfigError("--resume", f"a partial output {work} exists; pass --resume to continue it, "
                              f"or --overwrite to start again")
        check_outputs(specs, settings.overwrite)
    window = settings.window or default_window(net, fields, grid, settings.memory_budget,
                                               settings.torch_dtype, (reader.height, reader.width))
    plan = WindowPlan(height, width, out_h, out_w, fields[0], fields[1], grid, window, first_row=rows_done)
    skipped: set[tuple[int, int]] = set()
    if settings.tissue_only:
        tissue = TissueMap.from_overview(reader.thumbnail(OVERVIEW_SIDE), reader.height, reader.width)
        skipped = {(w.row, w.col) for w in plan.windows()
                   if tissue.fraction(w.core_footprint()) <= settings.min_tissue}
    return Plan(plan, skipped, rows_done, stamp, out_shape, fields, window, specs)


# ---------------------------------------------------------------------------- loop
class ProgressLine:
    """``[####....] windows 12/40 rows 3/10 2.1 MP/s`` on stderr (rank 0): one line per update off a terminal."""

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None, width: int = 30) -> None:
        self.total, self.enabled, self.width = max(1, total), enabled, width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, done: int, rows: str, rate: float) -> None:
        if not self.enabled:
            return
        filled = int(self.width * done / self.total)
        text = f"[{'#' * filled}{'.' * (self.width - filled)}] windows {done}/{self.total} rows {rows} {rate:.2f} MP/s"
        self.stream.write(("\r" + text + ("\n" if done >= self.total else "")) if self.tty else text + "\n")
        self.stream.flush()


@dataclass
class RankStats:
    """What one rank measured."""

    seconds: float = 0.0
    compute_seconds: float = 0.0
    read_seconds: float = 0.0
    read_wait_seconds: float = 0.0
    peak_bytes: int = 0
    state_bytes: int = 0
    windows: int = 0


TimelineEvent = dict[str, TraceValue | dict[str, TraceValue]]   # an Event as ``Event.as_dict`` gives it


@dataclass(frozen=True)
class InferSummary:
    """The run's result on rank 0: the command's JSON line (``dl.infer_slide`` returns ``as_dict()``)."""

    slide: str
    level: int
    slide_size: tuple[int, int]                  # (width, height) of the pixels read
    model: str
    checkpoint: str
    task: str
    classes: tuple[str, ...]
    mpp: float | None                            # µm per pixel read (None: unknown)
    scale: float                                 # resampling of the level read (1.0: none)
    placement: CellPlacement
    output_shape: tuple[int, int, int]           # classes, output rows, output columns
    output_stride: int
    fields: tuple[AxisField, AxisField]          # rows, columns
    world_size: int
    grid: tuple[int, int]
    window: int
    window_grid: tuple[int, int]
    dtype: str
    windows: int
    skipped_background: int
    computed_windows: int
    first_row: int
    rows_done: int
    complete: bool
    megapixels: float
    ranks: Sequence[RankStats]
    memory_source: str
    outputs: list[str]
    report: OutputReport | None = None           # per-class figures of the finished map (rank 0, complete runs)
    events: list[TimelineEvent] | None = None    # every rank's timeline (``keep_trace``)

    @property
    def seconds(self) -> float:
        return max(r.seconds for r in self.ranks)

    def as_dict(self) -> dict[str, object]:
        rows, cols = self.fields
        seconds = self.seconds
        return {
            "slide": self.slide, "level": self.level, "slide_size": list(self.slide_size),
            "mpp": self.mpp, "scale": self.scale, "model": self.model, "checkpoint": self.checkpoint,
            "task": self.task, "classes": list(self.classes),
            "output_shape": list(self.output_shape), "output_stride": self.output_stride,
            "field": {"rows": [rows.before, rows.after], "cols": [cols.before, cols.after],
                      "text": cols.describe()},
            "map": self.placement.describe(),
            "world_size": self.world_size, "grid": list(self.grid),
            "window": self.window, "window_grid": list(self.window_grid), "dtype": self.dtype,
            "windows": self.windows, "skipped_background": self.skipped_background,
            "computed_windows": self.computed_windows,
            "first_row": self.first_row, "rows_done": self.rows_done, "complete": self.complete,
            "seconds": seconds, "megapixels": self.megapixels,
            "megapixels_per_s": self.megapixels / seconds if seconds > 0 else None,
            "peak_memory_bytes": [r.peak_bytes for r in self.ranks],
            "memory_source": self.memory_source,
            "compute_seconds": [r.compute_seconds for r in self.ranks],
            "read_seconds": [r.read_seconds for r in self.ranks],
            "read_wait_seconds": [r.read_wait_seconds for r in self.ranks],
            "outputs": self.outputs,
            **(self.report.as_dict() if self.report is not None else {}),
            **({"events": self.events} if self.events is not None else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict())


class SlideFailed(RuntimeError):
    """A slide could not be read during the run; every rank raises it with the same message."""


class Runner:
    """Set up on every rank (errors agreed), then stream the windows; rank 0 writes and summarizes.

    ``trained``: the network, when the caller loaded it already (a cohort loads it once).
    """

    def __init__(self, settings: InferSettings, ctx: Comm, trained: TrainedNetwork | None = None) -> None:
        settings.check()
        self.settings, self.ctx = settings, ctx
        self.grid = TileGrid.from_slice_method(settings.slice_method, settings.num_spatial_parts)
        if ctx.world_size != self.grid.num_tiles:
            raise ConfigError("--num-spatial-parts", f"{self.grid.num_tiles} ranks share each window "
                              f"({self.grid.rows} x {self.grid.cols}) but {ctx.world_size} were launched; run "
                              f"with mpiexec -n {self.grid.num_tiles}")
        self.trained = trained if trained is not None else agreed(ctx, lambda: load_network(
            settings.checkpoint, family=settings.model, dtype=settings.torch_dtype,
            output_stride=settings.output_stride, task=settings.task))
        self.net, self.description = self.trained.net, self.trained.description
        self.reader = agreed(ctx, lambda: SlideReader(settings.slide, settings.level, mpp=settings.target_mpp,
                                                      trained_at=self.trained.mpp, source_mpp=settings.source_mpp))
        decided = agreed(ctx, lambda: decide(settings, self.trained, self.reader, self.grid) if ctx.rank == 0 else None)
        plan = ctx.bcast_object(decided, root=0)
        assert plan is not None   # rank 0 decided (else every rank raised in agreed)
        self.plan: Plan = plan
        agreed(ctx, lambda: check_halos(self.net, self.grid, sorted(self.plan.plan.input_sizes())))
        # decoded tiles kept for the overlap with the next window: twice this rank's RGBA box
        self.reader.limit_cache(CACHE_WINDOWS * 4 * max(h * w for h, w in self.plan.plan.input_sizes())
                                // self.grid.num_tiles)
        self.placement = CellPlacement(self.net.shape.stride, self.trained.cell_extent, self.plan.out_shape[1:],
                                       (self.reader.height, self.reader.width), self.reader.downsample,
                                       self.reader.mpp)
        self.store: HeatmapStore | None = None
        if ctx.rank == 0:
            work = work_path(npy_base(self.plan.outputs))
            dtype = np.float64 if settings.dtype == "float64" else np.float32
            self.store = HeatmapStore(work, self.plan.out_shape, np.dtype(dtype), create=self.plan.rows_done == 0)
        self._out_sizes: dict[tuple[int, int], tuple[int, int]] = {}
        self.read_error: str | None = None

    # ------------------------------------------------------------- pieces
    def window_output_size(self, window: Window) -> tuple[int, int]:
        size = window.input_size
        if size not in self._out_sizes:
            self._out_sizes[size] = output_size(self.net, *size)
        return self._out_sizes[size]

    def my_piece(self, window: Window, out: torch.Tensor) -> tuple[Box, np.ndarray] | None:
        """This rank's part of ``window``'s core: (box in global output cells, values)."""
        oh, ow = self.window_output_size(window)
        owned = self.grid.tile_box(self.ctx.rank, oh, ow) if self.grid.num_tiles > 1 else (0, oh, 0, ow)
        if tuple(out.shape[-2:]) != (owned[1] - owned[0], owned[3] - owned[2]):
            raise RuntimeError(f"window {window.row},{window.col}: output tile {tuple(out.shape[-2:])} is not the "
                               f"owned box {owned} of {oh}x{ow}")
        part = intersect(window.core_in_output, owned)
        if part is None:
            return None
        r0, r1, c0, c1 = part
        values = out[:, r0 - owned[0]:r1 - owned[0], c0 - owned[2]:c1 - owned[2]].cpu().numpy()
        dy, dx = window.core[0] - window.core_in_output[0], window.core[2] - window.core_in_output[2]
        return (r0 + dy, r1 + dy, c0 + dx, c1 + dx), values

    def read(self, window: Window) -> torch.Tensor:
        """This rank's box of ``window`` as a (3, h, w) tensor in [0, 1] (called in the prefetch thread).

        A read that fails gives zeros and is remembered: the ranks agree on it after the window row
        (``_check_reads``), so all stop together instead of some waiting for a halo forever.
        """
        start = time.perf_counter()
        box = window.rank_box(self.grid, self.ctx.rank) if self.grid.num_tiles > 1 else window.input
        try:
            pixels = self.reader.read(box)
        except Exception as err:   # OpenSlide, Pillow and codecs raise many kinds
            if self.read_error is None:
                self.read_error = (f"--slide {self.reader.path}: reading pixels {box} (rows, then columns, at "
                                   f"level {self.reader.level}) failed: {type(err).__name__}: {err}")
            pixels = np.zeros((box[1] - box[0], box[3] - box[2], 3), dtype=np.uint8)
        tensor = torch.from_numpy(pixels).permute(2, 0, 1).to(self.settings.torch_dtype).div_(255.0)
        self.stats.read_seconds += time.perf_counter() - start
        if self.settings.keep_trace:
            self.ctx.tracer.record("read", start - self.ctx.tracer.origin, self.ctx.tracer.now(),
                                   window=(window.row, window.col))
        return tensor

    def _check_reads(self) -> None:
        """Collective: stop every rank at once, with the first rank's message, if any read failed."""
        errors = [e for e in self.ctx.all_gather_object(self.read_error) if e is not None]
        if errors:
            raise SlideFailed(errors[0])

    # ---------------------------------------------------------------- run
    def run(self) -> InferSummary | None:
        """Stream every window row (or ``max_window_rows`` of them); the summary on rank 0, None elsewhere.

        Memory is sampled after every layer and after taking each prefetched window, on the main thread only,
        so the peak is the same on every run of the same window size (a sample from the reading thread would
        land inside an operator of the forward at random).
        """
        from ..spatial.convert import spatialize

        settings, ctx, plan = self.settings, self.ctx, self.plan
        net: nn.Module = self.net
        if self.grid.num_tiles > 1:
            net = spatialize(self.net, self.grid, ctx, elementwise=(nn.Softmax,))
        self.stats = RankStats(state_bytes=state_bytes(self.net))
        self.meter = PeakMeter(ctx.device)
        net.to(ctx.device)
        self.meter.watch(net.modules())
        rows = list(plan.plan.window_rows())
        if settings.max_window_rows is not None:
            rows = rows[:settings.max_window_rows]
        todo = [w for row in rows for w in row if (w.row, w.col) not in plan.skipped]
        total = sum(len(r) for r in rows)
        bar = ProgressLine(total, settings.progress and ctx.rank == 0)
        tracer = ctx.tracer
        tracing = tracer.enabled
        tracer.enabled = settings.keep_trace
        self.meter.start()
        wall = time.perf_counter()
        prefetch = Prefetcher(todo, self.read, depth=1)
        stream = iter(prefetch)
        done = skipped = 0
        slide_pixels = self.reader.height * self.reader.width
        computed_pixels = 0.0
        rows_done = plan.rows_done
        try:
            for row in rows:
                active = [w for w in row if (w.row, w.col) not in plan.skipped]
                for group in batches(active, settings.batch_windows):
                    tiles = [next(stream)[1] for _ in group]
                    self.meter.sample()
                    start = time.perf_counter()
                    with torch.no_grad(), tracer.span("compute", windows=len(group)):
                        out = net(torch.stack(tiles).to(ctx.device))
                    self.stats.compute_seconds += time.perf_counter() - start
                    self.meter.sample()
                    pieces = [self.my_piece(w, out[i]) for i, w in enumerate(group)]
                    del out, tiles
                    self._collect([p for p in pieces if p is not None])
                    self.stats.windows += len(group)
                    computed_pixels += sum(slide_share(w, plan.plan, slide_pixels) for w in group)
                self._check_reads()
                skipped += len(row) - len(active)
                rows_done = row[0].core[1]
                self._finish_row(row, rows_done)
                done += len(row)
                elapsed = time.perf_counter() - wall
                bar.update(done, f"{row[0].row + 1}/{len(rows)}", computed_pixels / 1e6 / max(elapsed, 1e-9))
                if not settings.keep_trace:
                    tracer.clear()
        finally:
            prefetch.close()
        self.stats.read_wait_seconds = prefetch.wait_seconds
        self.stats.seconds = time.perf_counter() - wall
        self.meter.sample()
        self.meter.unwatch()
        complete = rows_done >= plan.out_shape[1]
        events = None
        if settings.keep_trace:
            from ..comm.timeline import gather_timeline

            events = [e.as_dict() for e in gather_timeline(ctx) or []]
        tracer.enabled = tracing
        ctx.barrier()
        report = self._finalize() if complete and ctx.rank == 0 else None
        self.stats.peak_bytes = self.stats.state_bytes + self.meter.peak
        outputs = [str(s.path) for s in plan.outputs] if report is not None else []
        return self._summary(done, skipped, computed_pixels, complete, outputs, rows_done, report, events)

    def _collect(self, pieces: list[tuple[Box, np.ndarray]]) -> None:
        gathered = self.ctx.gather_object(pieces, root=0)
        if gathered is None or self.store is None:
            return
        start = time.perf_counter()
        for part in gathered:
            for box, values in part:
                self.store.write(box, values)
        del gathered
        self.meter.sample()
        self.ctx.tracer.record("write", start - self.ctx.tracer.origin, self.ctx.tracer.now())

    def _finish_row(self, row: list[Window], rows_done: int) -> None:
        if self.store is None:
            return
        for window in row:
            if (window.row, window.col) in self.plan.skipped:
                self.store.fill(window.core)
        self.store.flush()
        save_progress(progress_path(self.store.path), self.plan.fingerprint, rows_done)

    def _finalize(self) -> OutputReport:
        """Rank 0, all rows done: the outputs from the probability array (streaming, sampled by the meter)."""
        assert self.store is not None
        work = self.store.path
        self.store.close()
        settings, trained = self.settings, self.trained
        heat = settings.heat_class if settings.heat_class is not None else self.net.shape.classes - 1
        threshold = settings.threshold
        if threshold is None and trained.task is Task.CLASSIFICATION:
            threshold = CLASSIFIER_THRESHOLD
        request = OutputRequest(
            specs=self.plan.outputs, classes=trained.classes, placement=self.placement, heat_class=heat,
            threshold=threshold, excluded=tuple(class_indices(settings.exclude_classes, trained.classes)),
            min_area=settings.min_area, labels=trained.task is Task.SEGMENTATION, overlay_side=settings.overlay_side,
            description=self.describe(heat))
        report = write_outputs(work, request, self.reader, tick=self.meter.sample)
        progress_path(work).unlink(missing_ok=True)
        return report

    def describe(self, heat: int) -> dict[str, object]:
        """What the map shows (stored in the .tif and the summary)."""
        rows, cols = self.plan.fields
        return {"slide": str(self.reader.path), "level": self.reader.level, "scale": self.reader.choice.scale,
                "slide_mpp": self.reader.base_mpp, "heat_class": heat, "stride": self.net.shape.stride,
                "field_rows": [rows.before, rows.after], "field_cols": [cols.before, cols.after],
                "model": self.description.describe(), "task": str(self.trained.task), **self.placement.describe()}

    def _summary(self, windows: int, skipped: int, pixels: float, complete: bool, outputs: list[str],
                 rows_done: int, report: OutputReport | None,
                 events: list[TimelineEvent] | None) -> InferSummary | None:
        per_rank = self.ctx.gather_object(self.stats, root=0)
        if per_rank is None:
            return None
        plan = self.plan.plan
        return InferSummary(
            str(self.reader.path), self.reader.level, (self.reader.width, self.reader.height),
            self.description.describe(), self.description.path, str(self.trained.task), self.trained.classes,
            self.reader.mpp, self.reader.choice.scale, self.placement, self.plan.out_shape, self.net.shape.stride,
            self.plan.fields, self.ctx.world_size, (self.grid.rows, self.grid.cols), self.plan.window,
            plan.shape, self.settings.dtype, windows, skipped, self.stats.windows, self.plan.rows_done, rows_done,
            complete, pixels / 1e6, per_rank, self.meter.source, outputs, report, events)

    def close(self) -> None:
        """Release the slide (a cohort opens many)."""
        self.reader.close()


def slide_share(window: Window, plan: WindowPlan, slide_pixels: int) -> float:
    """The window's share of the slide level's pixels: its core's share of the output cells."""
    r0, r1, c0, c1 = window.core
    return slide_pixels * (r1 - r0) * (c1 - c0) / max(1, plan.out_height * plan.out_width)
