"""Whole-slide training steps measured per rank: one process or tiles + the layer rank of the pool head, a canvas
each rank reads only its tile of, one engine step's measured peak bytes on every rank, the largest canvas in a
budget."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.comm.protocol import Comm
from mpi4dl_nb.measure.steps import measure_engine_step
from mpi4dl_nb.models.canvas import canvas_multiples
from mpi4dl_nb.pipeline.step_input import ShardedImages
from mpi4dl_nb.spatial.geometry import Box, TileGrid

GRIDS = {1: None, 4: (2, 2), 8: (2, 4)}   # tile ranks -> tile grid (rows, columns); 1: one process
MIB = 2.0 ** 20


def processes(tiles: int) -> int:
    """One process, or the tiles plus the layer rank that holds the pool head (as ``train --whole-slide`` lays
    it out: ``--split-size 2 --spatial-size 1``)."""
    return 1 if GRIDS[tiles] is None else tiles + 1


def layout_name(tiles: int) -> str:
    grid = GRIDS[tiles]
    return "one process" if grid is None else f"{grid[0]}x{grid[1]} tiles + 1 layer rank"


def canvas_multiple(tiles: int, stride: int) -> int:
    """Square canvas sides on ``tiles`` tile ranks must be multiples of this (every tile whole trunk strides)."""
    grid = GRIDS[tiles]
    return stride if grid is None else math.lcm(*canvas_multiples(TileGrid(*grid), stride))


def whole_slide_config(tiles: int, layers: int, *, recompute: bool = False, bf16: bool = False) -> dl.ParallelConfig:
    """The layout of ``tiles`` (1: one process): the trunk on the tiles, the last layer (the head) on a layer rank."""
    checkpoint = "every" if recompute else None
    precision = "bf16" if bf16 else "fp32"
    grid = GRIDS[tiles]
    if grid is None:
        return dl.ParallelConfig(split_size=1, spatial_size=0, num_spatial_parts=1,
                                 checkpoint_activations=checkpoint, precision=precision)  # type: ignore[arg-type]
    return dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=tiles, grid=grid,
                             balance=(layers - 1, 1), checkpoint_activations=checkpoint,
                             precision=precision)  # type: ignore[arg-type]


def canvas_reader(side: int, channels: int = 3) -> ShardedImages:
    """One slide's canvas as each rank reads it: only its ``box`` (random pixels, drawn per box: memory does not
    depend on them)."""
    def read(rows: slice, box: Box | None) -> torch.Tensor:
        r0, r1, c0, c1 = box if box is not None else (0, side, 0, side)
        generator = torch.Generator().manual_seed(r0 * 100_003 + c0)
        return torch.rand(1, channels, r1 - r0, c1 - c0, generator=generator)

    return ShardedImages(read, 1, (side, side))


def step_peaks(ctx: Comm, build: Callable[[], list[nn.Module]], tiles: int, side: int, *, recompute: bool = False,
               bf16: bool = False) -> list[int]:
    """Every rank's measured peak bytes of one whole-slide training step (batch 1, SGD with momentum) at ``side``
    px on a fresh engine: ``measure_engine_step`` (after a warm-up step, under the allocation profiler: held
    parameters, buffers, gradients, optimizer state and the most the step allocates on top). Collective."""
    layers = build()
    engine = dl.HybridEngine(layers, whole_slide_config(tiles, len(layers), recompute=recompute, bf16=bf16), ctx,
                             loss_fn=nn.CrossEntropyLoss(), image_size=side,
                             optimizer=lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9))
    peak = measure_engine_step(engine, canvas_reader(side), torch.tensor([1]), warmup=1)
    del engine, layers
    return [int(p) for p in ctx.all_gather_object(peak)]


@dataclass(frozen=True)
class Found:
    """A search's answer: the largest side that fits, its measured peak per rank (bytes, each rank), the smallest
    side measured not to fit (None: none measured), and how many sides were measured."""

    side: int
    peaks: list[int]
    too_big: int | None
    measured: int


def largest_side(budget: float, multiple: int, start: int, measure: Callable[[int], list[int]],
                 log: Callable[[int, int, bool], None] = lambda side, peak, fits: None) -> Found:
    """The largest side (a multiple of ``multiple``) whose largest measured peak (``measure(side)``: bytes per
    rank) is within ``budget`` bytes, from measurements only: ``start``, then from every side that fits the side
    the last two fitting sides predict (peak = fixed + bytes per pixel x pixels), at most double and at least one
    multiple more, until one does not fit; then a bisection between the largest side that fits and the smallest
    that does not. ``log(side, peak, fits)`` hears every measurement. SystemExit when ``start`` does not fit."""
    seen: dict[int, list[int]] = {}

    def fits(side: int) -> bool:
        seen[side] = measure(side)
        log(side, max(seen[side]), max(seen[side]) <= budget)
        return max(seen[side]) <= budget

    lo = max(multiple, start // multiple * multiple)
    if not fits(lo):
        raise SystemExit(f"the first side measured, {lo} px, needs {max(seen[lo]) / MIB:.0f} MiB per rank, over "
                         f"the budget of {budget / MIB:g} MiB; raise the budget or start smaller")
    hi: int | None = None
    side = 2 * lo
    while hi is None:
        if fits(side):
            lo = side
            a, b = sorted(s for s in seen if max(seen[s]) <= budget)[-2:]
            per_pixel = (max(seen[b]) - max(seen[a])) / (b * b - a * a)
            fixed = max(seen[b]) - per_pixel * b * b
            predicted = math.sqrt(max(0.0, budget - fixed) / per_pixel) if per_pixel > 0 else 2.0 * lo
            side = max(lo + multiple, min(2 * lo, int(predicted) // multiple * multiple))
        else:
            hi = side
    while hi - lo > multiple:
        mid = (lo + hi) // 2 // multiple * multiple
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return Found(lo, seen[lo], hi, len(seen))
