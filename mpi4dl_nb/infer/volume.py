"""Dense inference over a volume larger than memory: window by window (``windows.BoxPlan``) on spatial ranks.

Every rank reads only its tile of each window (zeros past the volume's sides up to the window
unit), runs the spatialized fully convolutional network (halo exchanges in depth, rows and
columns), and sends rank 0 its part of the window's core; rank 0 writes the label and
probability volumes through memory maps (``outputs/volume.py``). Each core cell's field lies
inside its window, so every written voxel equals the whole-volume network's. A rank holds one
window's tile and activations at a time: its memory does not grow with the volume. A NIfTI scan is predicted in the RAS
axes it is read in (``data/volume/orientation.py``) and its outputs written back into its own grid and header.

A network whose every voxel depends on the whole volume (``whole_volume.WholeInput``: window attention,
InstanceNorm) runs as one window, the whole volume split over the ranks' tiles: exact, a rank holding its 1/P share of
one process's forward plus the attention windows gathered across tile seams (the number of ranks is the user's
choice; the progress line says the memory).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ..comm.agreement import agreed
from ..config import ConfigError
from ..data.volume.orientation import GRID, Orientation
from ..data.volume.space import ScanSpace
from ..measure.heap import PeakMeter, module_bytes
from ..spatial.geometry import AXIS_NAMES, TileGrid
from .fully_conv import FullyConvolutional, measure_fields
from .outputs.volume import VolumeOutputs, VolumeSink
from .pace import PacedProgress
from .probes import check_halos, input_channels, output_sizes
from .volume_source import VolumeSource, read_zero_extended
from .whole_volume import bytes_per_voxel, check_whole_sides, whole_input_layer
from .windows import AxisField, AxisWindows, BoxPlan, BoxWindow, Extent, ceil_div, intersect_extents, padded_extent

if TYPE_CHECKING:
    from ..comm.protocol import Comm

WHOLE_FIELD = AxisField(stride=1, before=0, after=0, align=1)   # a voxel per voxel; the window is the volume
Piece = tuple[Extent, np.ndarray]     # output cells (volume coordinates) and their class probabilities


@dataclass(frozen=True)
class VolumeSummary:
    """What a volume run did (rank 0): the command's JSON line."""

    volume: str
    shape: tuple[int, int, int]
    voxel_size: tuple[float, float, float] | None
    orientation: str                  # the scan's stored axes ("LAS, oblique 12.0°"), or "no stated axes"
    outputs: list[str]
    grid: tuple[int, ...]
    window: tuple[int, ...]
    window_grid: tuple[int, ...]
    windows: int
    fields: list[tuple[int, int]]
    dtype: str
    seconds: float
    voxels_per_s: float
    peak_memory_bytes: list[int]
    memory_source: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def volume_grid(grid: TileGrid) -> TileGrid:
    """The grid a volume's windows are cut by: a 1 x 1 grid of one process is the 1 x 1 x 1 one."""
    if grid.volumetric:
        return grid
    if grid.num_tiles == 1:
        return TileGrid(1, 1, 1)
    raise ConfigError("--slice-method", f"a volume's windows are cut in depth, rows and columns: give DxRxC "
                                        f"(e.g. 1x{grid.rows}x{grid.cols}) rather than a 2-D grid")


def window_sides(window: int | Sequence[int]) -> tuple[int, int, int]:
    """``--window N`` (every axis) or ``D,H,W``: input voxels per rank per axis."""
    sides = (window,) * 3 if isinstance(window, int) else tuple(int(w) for w in window)
    if len(sides) != 3:
        raise ConfigError("--window", f"a volume's window is N or D,H,W voxels per rank, got {window}")
    return sides[0], sides[1], sides[2]


class VolumeRunner:
    """Set up on every rank (errors agreed), then stream the windows; rank 0 writes the volumes."""

    def __init__(self, net: FullyConvolutional, source: VolumeSource, outputs: VolumeOutputs | None, ctx: Comm,
                 grid: TileGrid, window: int | Sequence[int], *, dtype: torch.dtype = torch.float32,
                 progress: bool = False, overwrite: bool = False) -> None:
        self.ctx, self.source, self.dtype, self.progress = ctx, source, dtype, progress
        self.grid = volume_grid(grid)
        if ctx.world_size != self.grid.num_tiles:
            raise ConfigError("--num-spatial-parts", f"{self.grid.num_tiles} ranks share each window but "
                              f"{ctx.world_size} were launched; run with mpiexec -n {self.grid.num_tiles}")
        if net.shape.dims != 3:
            raise ConfigError("--checkpoint", "volume inference needs a 3-D network (Conv3d layers, e.g. --model "
                                              "unet3d); a 2-D network takes --slide")
        self.net = net.to(dtype)
        self.channels = input_channels(net)
        if source.channels != self.channels:
            raise ConfigError("--volume", f"{source.name} has {source.channels} channel(s) but the network reads "
                                          f"{self.channels}")
        self.whole = whole_input_layer(list(net))
        self.window = window_sides(window) if self.whole is None else self._whole_window()
        self.fields: tuple[AxisField, ...] = (WHOLE_FIELD,) * 3 if self.whole is not None else self._measured()
        self.plan = agreed(ctx, self._plan)
        if self.whole is None and self.grid.num_tiles > 1:
            agreed(ctx, lambda: check_halos(net, self.grid, sorted(self.plan.input_sizes()), self.channels))
        self.rank_bytes = self._whole_memory() if self.whole is not None and progress else None
        self.out_shape = tuple(ceil_div(n, f.stride) for n, f in zip(source.shape, self.fields))
        self.outputs = outputs
        if outputs is not None and ctx.rank == 0:
            agreed(ctx, lambda: outputs.check_free(overwrite))
        elif outputs is not None:
            agreed(ctx, lambda: None)
        self._out_sizes: dict[tuple[int, ...], tuple[int, ...]] = {}

    def _measured(self) -> tuple[AxisField, ...]:
        """The field of an output cell along every axis, probed on rank 0 (errors agreed), known on every rank."""
        found = agreed(self.ctx, lambda: measure_fields(self.net, self.channels) if self.ctx.rank == 0 else None)
        fields = self.ctx.bcast_object(found, root=0)
        assert fields is not None    # rank 0 measured (else every rank raised in agreed)
        return tuple(fields)

    def _whole_window(self) -> tuple[int, int, int]:
        """A network that needs the whole volume: its sides checked (errors agreed); one window, the whole volume
        over the grid (``--window`` does not apply)."""
        whole = self.whole
        assert whole is not None
        agreed(self.ctx, lambda: check_whole_sides(whole, self.source.shape))
        d, h, w = (ceil_div(n, p) for n, p in zip(self.source.shape, self.grid.shape))
        return d, h, w

    def _whole_memory(self) -> int | None:
        """About the bytes a rank's share of the whole-volume forward holds (1/P of one process's, measured on
        two small volumes on rank 0; for the progress line only), None where the heap cannot be measured."""
        assert self.whole is not None
        side, ctx = 2 * self.whole.input_multiple, self.ctx
        found = agreed(ctx, lambda: bytes_per_voxel(self.net, side, self.channels, self.dtype)
                       if ctx.rank == 0 else None)
        per_voxel = ctx.bcast_object(found, root=0)
        if per_voxel is None:
            return None
        return int(per_voxel * float(np.prod(self.source.shape)) / self.grid.num_tiles)

    def _plan(self) -> BoxPlan:
        padded = [padded_extent(n, f.unit) for n, f in zip(self.source.shape, self.fields)]
        cells = tuple(padded) if self.whole is not None else output_sizes(self.net, padded, self.channels)
        axes = zip(AXIS_NAMES, self.fields, padded, cells, self.grid.shape, self.window)
        return BoxPlan(tuple(AxisWindows(name, field, extent, count, parts, side, fit_whole=True)
                             for name, field, extent, count, parts, side in axes))

    def window_output(self, window: BoxWindow) -> tuple[int, ...]:
        size = window.input_size
        if self.whole is not None:
            return size              # a voxel per voxel (checked by whole_volume_network)
        if size not in self._out_sizes:
            self._out_sizes[size] = output_sizes(self.net, size, self.channels)
        return self._out_sizes[size]

    def my_piece(self, window: BoxWindow, out: torch.Tensor) -> Piece | None:
        """This rank's part of ``window``'s core: (cells in volume coordinates, probabilities)."""
        sizes = self.window_output(window)
        owned = self.grid.extent(self.ctx.rank, sizes)
        if tuple(out.shape[1:]) != tuple(b - a for a, b in owned):
            raise RuntimeError(f"window {window.index}: output tile {tuple(out.shape[1:])} is not the owned "
                               f"extent {owned} of {sizes}")
        part = intersect_extents(window.core_in_output, owned)
        if part is None:
            return None
        values = out[(slice(None), *(slice(a - o0, b - o0) for (a, b), (o0, _) in zip(part, owned)))]
        shift = [c0 - w0 for (c0, _), (w0, _) in zip(window.core, window.core_in_output)]
        return tuple((a + d, b + d) for (a, b), d in zip(part, shift)), values.cpu().numpy()

    def run(self) -> VolumeSummary | None:
        """Every window in turn; the summary on rank 0, None elsewhere (collective)."""
        from ..spatial.convert import spatialize

        ctx = self.ctx
        net: nn.Module = self.net.eval()
        if self.grid.num_tiles > 1:
            net = spatialize(self.net, self.grid, ctx, elementwise=(nn.Softmax,))
        net.to(ctx.device)
        sink = None
        if self.outputs is not None and ctx.rank == 0:
            out_shape = (self.out_shape[0], self.out_shape[1], self.out_shape[2])
            sink = VolumeSink(self.outputs, out_shape, self.net.shape.classes, self.output_voxel_size(),
                              self.output_space())
        meter = PeakMeter(ctx.device)
        meter.watch(net.modules())
        windows = self.plan.windows()
        bar = PacedProgress(len(windows), self.progress and ctx.rank == 0)
        if self.whole is not None:
            bar.note(self.whole_note())
        meter.start()
        wall = time.perf_counter()
        for done, window in enumerate(windows, 1):
            extent = window.rank_extent(self.grid, ctx.rank)
            tile = torch.from_numpy(read_zero_extended(self.source, extent)).to(self.dtype)[None]
            meter.sample()
            with torch.no_grad():
                out = net(tile.to(ctx.device))[0]
            meter.sample()
            piece = self.my_piece(window, out)
            del out, tile
            gathered = ctx.gather_object([] if piece is None else [piece], root=0)
            if sink is not None and gathered is not None:
                for part in gathered:
                    for cells, values in part:
                        sink.write(cells, values)
            del gathered
            meter.sample()
            bar.update(done, f"windows {done}/{len(windows)}", self.voxels_done(done) / 1e6, "Mvoxel")
        seconds = time.perf_counter() - wall
        meter.unwatch()
        if sink is not None:
            sink.close()
        peaks = ctx.gather_object(module_bytes(self.net) + meter.peak, root=0)
        if peaks is None:
            return None
        voxels = float(np.prod(self.source.shape))
        return VolumeSummary(
            self.source.name, self.source.shape, self.source.voxel_size, self.orientation().describe(),
            [str(p) for p in self.outputs.paths] if self.outputs is not None else [], self.grid.shape,
            self.window, self.plan.shape, len(windows), [(f.before, f.after) for f in self.fields],
            str(self.dtype).removeprefix("torch."), seconds, voxels / max(seconds, 1e-9), peaks, meter.source)

    def whole_note(self) -> str:
        """What a whole-volume run does and the memory a rank needs for it (the user's choice of ranks)."""
        share = "" if self.rank_bytes is None else f"{self.rank_bytes / 2 ** 20:.0f}"
        memory = share and (f", about {share} MiB per rank (1/P of one process's forward) plus the windows gathered "
                            f"across seams")
        sides = "x".join(map(str, self.source.shape))
        return (f"one window: the whole {sides} volume (every voxel depends on all of it) on "
                f"{self.grid.num_tiles} rank(s){memory}; more --num-spatial-parts take less per rank")

    def voxels_done(self, windows: int) -> float:
        """Voxels of the volume the first ``windows`` windows' cores cover (approximately: by window count)."""
        return float(np.prod(self.source.shape)) * windows / max(1, int(np.prod(self.plan.shape)))

    def orientation(self) -> Orientation:
        """How the volume was read from its file (a NIfTI scan: in RAS axes; else as stored)."""
        space = self.source.space
        return GRID if space is None else space.orientation

    def output_space(self) -> ScanSpace | None:
        """A NIfTI scan's grid and header at the network's stride: the outputs are written back into it."""
        space = self.source.space
        if space is None:
            return None
        d, h, w = (f.stride for f in self.fields)
        return space.at_stride((d, h, w))

    def output_voxel_size(self) -> tuple[float, float, float] | None:
        """µm per output cell along (z, y, x): the input's voxel size times the network's stride."""
        size = self.source.voxel_size
        if size is None:
            return None
        z, y, x = (s * f.stride for s, f in zip(size, self.fields))
        return (z, y, x)
