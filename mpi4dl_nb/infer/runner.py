"""The streaming loop of slide inference: set-up agreed by every rank, then window rows of spatial forwards.

Every rank of the window grid reads only its own box of each window (a prefetch thread reads
the next while the current one computes), runs the spatialized fully convolutional network
(halo exchanges between the ranks of the window), and sends rank 0 its part of the window's
core; rank 0 writes it into the probability array and, after each window row, records that
the rows above are final (``--resume`` continues from there).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ..comm.agreement import agreed
from ..config import ConfigError
from ..console import SetupLines
from ..data.pathology import slide_overview
from ..data.read_ahead import ReadAhead
from ..data.stain import PixelMap
from ..data.stain_reads import stain_normalized
from ..data.task import Task
from ..measure.heap import PeakMeter, module_bytes
from ..spatial.geometry import Box, TileGrid
from .decisions import Plan, class_indices, decide, settled_map_mode
from .job import InferJob
from .outputs.finish import CLASSIFIER_THRESHOLD, OutputReport, OutputRequest, write_outputs
from .outputs.heat import default_heat_class
from .outputs.kinds import OutputKind, npy_base
from .outputs.placement import CellPlacement
from .pace import PacedProgress
from .probes import check_halos, output_size
from .reader import SlideReader
from .store import HeatmapStore, progress_path, save_progress, work_path
from .summary import InferSummary, RankStats, TimelineEvent
from .tile_map import MapMode, TileClassifier, TileGeometry, auto_choice_text
from .trained import TrainedNetwork, load_network
from .windows import Window, WindowPlan, batches, intersect

if TYPE_CHECKING:
    from ..comm.protocol import Comm

CACHE_WINDOWS = 2                 # OpenSlide's tile cache holds this many of a rank's window boxes


@dataclass
class StreamCount:
    """What the window loop has done so far."""

    rows_done: int = 0           # output rows final (saved for --resume)
    done: int = 0                # windows of the finished rows, skipped ones included
    skipped: int = 0             # windows without tissue (--tissue-only)
    pixels: float = 0.0          # slide pixels computed


class SlideFailed(RuntimeError):
    """A slide could not be read during the run; every rank raises it with the same message. ``kept``: rows are
    saved for ``--resume`` (else no partial output is left behind)."""

    def __init__(self, message: str, kept: bool = False) -> None:
        super().__init__(message)
        self.kept = kept

BATCH_TILES = 16       # tiles per forward in --map-mode tiles (times --batch-windows)
COORDINATES = "level-0 pixels of QuPath's image: OpenSlide's level 0 minus the slide's bounds origin"


class SlideRunner:
    """Set up on every rank (errors agreed), then stream the windows; rank 0 writes and summarizes.

    ``trained``: the network, when the caller loaded it already (a cohort loads it once, settles the map mode and says
    each slide); else the one of the checkpoint file ``checkpoint`` (None: the one the job names) is loaded once the
    grid fits the ranks, and rank 0 says each part of the set-up (with progress on) and what ``--map-mode auto``
    chose.
    """

    def __init__(self, job: InferJob, ctx: Comm, trained: TrainedNetwork | None = None,
                 checkpoint: Path | None = None) -> None:
        job.check_flags()
        self.job, self.ctx = job, ctx
        slide = job.slide
        if slide is None:
            raise ConfigError("--slide", "give the slide to run (a cohort runs each of its slides as one)")
        self.grid = TileGrid.from_slice_method(job.slice_method, job.num_spatial_parts)
        if ctx.world_size != self.grid.num_tiles:
            raise ConfigError("--num-spatial-parts", f"{self.grid.num_tiles} ranks share each window "
                              f"({self.grid.rows} x {self.grid.cols}) but {ctx.world_size} were launched; run "
                              f"with mpiexec -n {self.grid.num_tiles}")
        setup = SetupLines("infer", job.progress and ctx.rank == 0 and trained is None)
        if trained is None:
            setup.doing(f"loading the checkpoint {checkpoint or job.checkpoint.path()}")
        self.trained = trained if trained is not None else trained_for(job, checkpoint, ctx)
        self.job = job = settled_job(job, self.trained, ctx, setup)
        self.net, self.description = self.trained.net, self.trained.description
        if self.net.shape.dims == 3:
            raise ConfigError("--checkpoint", f"{self.description.path} holds a volume network (3-D layers); run "
                                              f"it over a volume with --volume, not over a --slide")
        setup.doing(f"opening the slide {slide}")
        self.reader = agreed(ctx, lambda: SlideReader(slide, job.slide_level, mpp=job.target_mpp,
                                                      trained_at=self.trained.mpp,
                                                      source_mpp=job.resolution.source_mpp))
        stain = self.trained.stain if job.stain_normalize else None    # as training read its images
        self.stain: PixelMap | None = None if stain is None else agreed(
            ctx, lambda: stain.map_for(slide_overview(self.reader.slide)))
        setup.doing("planning the windows" + (" and finding tissue" if job.tissue_only else ""))
        decided = agreed(ctx, lambda: decide(job, self.trained, self.reader, self.grid) if ctx.rank == 0 else None)
        plan = ctx.bcast_object(decided, root=0)
        assert plan is not None   # rank 0 decided (else every rank raised in agreed)
        self.plan: Plan = plan
        if job.map_mode != MapMode.TILES:      # tiles mode (settled) reads lone tiles: no window split over ranks
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
            dtype = np.float64 if job.dtype == "float64" else np.float32
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
        tensor = self.read_box(box)
        self.stats.read_seconds += time.perf_counter() - start
        if self.job.keep_trace:
            self.ctx.tracer.record("read", start - self.ctx.tracer.origin, self.ctx.tracer.now(),
                                   window=(window.row, window.col))
        return tensor

    def read_box(self, box: Box) -> torch.Tensor:
        """``box``'s pixels as a (3, h, w) tensor in [0, 1], stain-normalised as in training; a failed read gives
        zeros and is remembered for ``_check_reads``."""
        try:
            pixels = self.reader.read(box)
        except Exception as err:   # OpenSlide, Pillow and codecs raise many kinds
            if self.read_error is None:
                self.read_error = (f"--slide {self.reader.path}: reading pixels {box} (rows, then columns, at "
                                   f"level {self.reader.level}) failed: {type(err).__name__}: {err}")
            pixels = np.zeros((box[1] - box[0], box[3] - box[2], 3), dtype=np.uint8)
        tensor = torch.from_numpy(pixels).permute(2, 0, 1).to(self.job.torch_dtype).div_(255.0)
        return tensor if self.stain is None else stain_normalized(tensor, self.stain)

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
        if self.job.map_mode == MapMode.TILES:
            return self._run_tiles()
        net = self._placed_network()
        rows = list(self.plan.plan.window_rows())[:self.job.max_window_rows]
        count = StreamCount(rows_done=self.plan.rows_done)
        tracer = self.ctx.tracer
        tracing, tracer.enabled = tracer.enabled, self.job.keep_trace
        self.meter.start()
        wall = time.perf_counter()
        prefetch = ReadAhead([w for row in rows for w in row if (w.row, w.col) not in self.plan.skipped],
                              self.read, depth=1)
        try:
            self._stream(net, rows, iter(prefetch), count)
        except SlideFailed as err:
            self._drop_empty_partial(count.rows_done)
            raise SlideFailed(str(err), kept=count.rows_done > 0) from None
        finally:
            prefetch.close()
        self.stats.read_wait_seconds = prefetch.wait_seconds
        self.stats.seconds = time.perf_counter() - wall
        self.meter.sample()
        self.meter.unwatch()
        events = None
        if self.job.keep_trace:
            from ..comm.timeline import gather_timeline

            events = [e.as_dict() for e in gather_timeline(self.ctx) or []]
        tracer.enabled = tracing
        return self._finish_stream(count, events)

    def _placed_network(self) -> nn.Module:
        """The network on this rank's device (spatialized over the window's ranks), its layers watched by the
        meter."""
        from ..spatial.convert import spatialize

        net: nn.Module = self.net
        if self.grid.num_tiles > 1:
            net = spatialize(self.net, self.grid, self.ctx, elementwise=(nn.Softmax,))
        self.stats = RankStats(state_bytes=module_bytes(self.net))
        self.meter = PeakMeter(self.ctx.device)
        net.to(self.ctx.device)
        self.meter.watch(net.modules())
        return net

    def _stream(self, net: nn.Module, rows: list[list[Window]], stream: Iterator[tuple[Window, torch.Tensor]],
                count: StreamCount) -> None:
        """Every window row through the network (background windows skipped), each row saved when done."""
        total = sum(len(r) for r in rows)
        bar = PacedProgress(total, self.job.progress and self.ctx.rank == 0)
        slide_pixels = self.reader.height * self.reader.width
        for row in rows:
            active = [w for w in row if (w.row, w.col) not in self.plan.skipped]
            for group in batches(active, self.job.batch_windows):
                self._forward(net, group, [next(stream)[1] for _ in group])
                count.pixels += sum(slide_share(w, self.plan.plan, slide_pixels) for w in group)
            self._check_reads()
            count.skipped += len(row) - len(active)
            count.rows_done = row[0].core[1]
            self._finish_row(row, count.rows_done)
            count.done += len(row)
            bar.update(count.done, f"windows {count.done}/{total} rows {row[0].row + 1}/{len(rows)}",
                       count.pixels / 1e6, "MP")
            if not self.job.keep_trace:
                self.ctx.tracer.clear()

    def _forward(self, net: nn.Module, group: list[Window], tiles: list[torch.Tensor]) -> None:
        """A batch of windows through the network; this rank's pieces of their cores sent to rank 0."""
        self.meter.sample()
        start = time.perf_counter()
        with torch.no_grad(), self.ctx.tracer.span("compute", windows=len(group)):
            out = net(torch.stack(tiles).to(self.ctx.device))
        self.stats.compute_seconds += time.perf_counter() - start
        self.meter.sample()
        pieces = [self.my_piece(w, out[i]) for i, w in enumerate(group)]
        del out, tiles
        self._collect([p for p in pieces if p is not None])
        self.stats.windows += len(group)

    def _finish_stream(self, count: StreamCount, events: list[TimelineEvent] | None) -> InferSummary | None:
        """After the last row: rank 0 writes the outputs of a complete map; the summary on rank 0."""
        complete = count.rows_done >= self.plan.out_shape[1]
        self.ctx.barrier()
        report = self._finalize() if complete and self.ctx.rank == 0 else None
        self.stats.peak_bytes = self.stats.state_bytes + self.meter.peak
        outputs = [str(s.path) for s in self.plan.outputs] if report is not None else []
        return self._summary(count.done, count.skipped, count.pixels, complete, outputs, count.rows_done, report,
                             events)

    def _run_tiles(self) -> InferSummary | None:
        """``--map-mode tiles``: each rank classifies every ``world``-th row of cells tile by tile; rank 0 stores
        the rows (cells without a whole tile stay NaN) and writes the outputs."""
        ctx, plan = self.ctx, self.plan
        geometry = TileGeometry(self.trained.cell_extent, self.net.shape.stride, plan.out_shape[1:],
                                (self.reader.height, self.reader.width))
        classifier = TileClassifier(self.trained.layers, self.job.torch_dtype, ctx.device)
        self.stats = RankStats(state_bytes=module_bytes(classifier.net))
        self.meter = PeakMeter(ctx.device)
        if self.store is not None:
            self.store.fill((0, plan.out_shape[1], 0, plan.out_shape[2]))
        rows = geometry.whole(0)
        bar = PacedProgress(rows, self.job.progress and ctx.rank == 0)
        wall = time.perf_counter()
        for first in range(0, rows, ctx.world_size):
            row = first + ctx.rank
            start = time.perf_counter()
            pieces = [] if row >= rows else [((row, row + 1, 0, plan.out_shape[2]), classifier.row(
                self.read_box, geometry, row, plan.out_shape[0], self.job.batch_windows * BATCH_TILES))]
            self.stats.compute_seconds += time.perf_counter() - start
            self.stats.windows += geometry.whole(1) if pieces else 0
            self._collect(pieces)
            try:
                self._check_reads()
            except SlideFailed as err:
                self._drop_empty_partial(0)        # a tile-mode run keeps nothing to resume
                raise SlideFailed(str(err), kept=False) from None
            shown = min(first + ctx.world_size, rows)
            bar.update(shown, f"tile rows {shown}/{rows}", shown * geometry.whole(1), "tiles")
        self.stats.seconds = time.perf_counter() - wall
        ctx.barrier()
        report = self._finalize() if ctx.rank == 0 else None
        self.stats.peak_bytes = self.stats.state_bytes + self.meter.peak
        outputs = [str(s.path) for s in plan.outputs] if report is not None else []
        pixels = float(self.reader.height * self.reader.width)
        return self._summary(self.stats.windows, 0, pixels, True, outputs, plan.out_shape[1], report, None)

    def _drop_empty_partial(self, rows_done: int) -> None:
        """Rank 0, the slide failed before any row was saved: no partial output stays behind (nothing to resume)."""
        if self.store is None or rows_done > 0:
            return
        self.store.close()
        self.store = None
        work = work_path(npy_base(self.plan.outputs))
        work.unlink(missing_ok=True)
        progress_path(work).unlink(missing_ok=True)

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
        job, trained = self.job, self.trained
        heat = job.heat_class if job.heat_class is not None else default_heat_class(trained.classes)
        drawn = {OutputKind.PREVIEW} | ({OutputKind.PNG} if trained.task is Task.CLASSIFICATION else set())
        if job.heat_class is None and any(s.kind in drawn for s in self.plan.outputs):
            print(f"mpi4dl_nb infer: the .png/.tif:preview draw P({trained.classes[heat]}) (class {heat}); "
                  f"--heat-class N draws another", file=sys.stderr, flush=True)
        threshold = job.threshold
        if threshold is None and trained.task is Task.CLASSIFICATION:
            threshold = CLASSIFIER_THRESHOLD
        request = OutputRequest(
            specs=self.plan.outputs, classes=trained.classes, placement=self.placement, heat_class=heat,
            threshold=threshold, excluded=tuple(class_indices(job.exclude_classes, trained.classes)),
            min_area=job.min_area, labels=trained.task is Task.SEGMENTATION, overlay_side=job.overlay_side,
            description=self.describe(heat))
        report = write_outputs(work, request, self.reader, tick=self.meter.sample)
        progress_path(work).unlink(missing_ok=True)
        return report

    def describe(self, heat: int) -> dict[str, object]:
        """What the map shows (stored in the .tif and the summary)."""
        rows, cols = self.plan.fields
        stain = "none" if self.stain is None or self.trained.stain is None else self.trained.stain.describe()
        return {"slide": str(self.reader.path), "stain": stain, "level": self.reader.level,
                "scale": self.reader.choice.scale,
                "slide_mpp": self.reader.base_mpp, "heat_class": heat, "stride": self.net.shape.stride,
                "field_rows": [rows.before, rows.after], "field_cols": [cols.before, cols.after],
                "model": self.description.describe(), "task": str(self.trained.task), **self.placement.describe(),
                "bounds": self.reader.bounds.describe(), "coordinates": COORDINATES}

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
            plan.shape, self.job.dtype, windows, skipped, self.stats.windows, self.plan.rows_done, rows_done,
            complete, pixels / 1e6, per_rank, self.meter.source, outputs, report, events)

    def close(self) -> None:
        """Release the slide (a cohort opens many)."""
        self.reader.close()


def slide_share(window: Window, plan: WindowPlan, slide_pixels: int) -> float:
    """The window's share of the slide level's pixels: its core's share of the output cells."""
    r0, r1, c0, c1 = window.core
    return slide_pixels * (r1 - r0) * (c1 - c0) / max(1, plan.out_height * plan.out_width)


def trained_for(job: InferJob, file: Path | None, ctx: Comm) -> TrainedNetwork:
    """The network of the checkpoint ``file`` (None: the one ``job`` names) as ``job`` runs it (``--model``,
    ``--dtype``, ``--output-stride``, ``--task``), loaded on every rank with the errors agreed."""
    return agreed(ctx, lambda: load_network(str(file if file is not None else job.checkpoint.path()),
                                            family=job.model, dtype=job.torch_dtype,
                                            output_stride=job.output_stride, task=job.task))


def settled_job(job: InferJob, trained: TrainedNetwork, ctx: Comm, setup: SetupLines) -> InferJob:
    """``job`` with its map mode settled by the network on every rank (errors agreed); ``setup`` says what
    ``--map-mode auto`` chose."""
    settled = agreed(ctx, lambda: settled_map_mode(job, trained))
    if job.map_mode == MapMode.AUTO:
        setup.note(auto_choice_text(settled.map_mode, trained.description.spec.label))
    return settled
