"""Activation bytes of a 3-D network's training step per tile rank on P = 2, 4, 8 tiles against one process."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mpi4dl_nb.comm.protocol import Comm
from mpi4dl_nb.measure.usage import ActivationMeter
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.geometry import TileGrid

GRIDS = {2: (2, 1, 1), 4: (2, 2, 1), 8: (2, 2, 2)}    # P tiles -> (depth, rows, cols): cut along depth first
BOUND = 1.15                                          # acceptance (issue 45): bytes per rank <= 1.15 / P of one process


def conv_stack3d(channels: int = 4, convs: int = 4, in_channels: int = 1) -> list[nn.Module]:
    """The 3-D conv stack measured: ``convs`` times Conv3d 3x3x3 (padding 1) + ReLU, ``channels`` wide."""
    layers: list[nn.Module] = []
    for index in range(convs):
        layers += [nn.Conv3d(in_channels if index == 0 else channels, channels, 3, padding=1), nn.ReLU()]
    return layers


@dataclass(frozen=True)
class Measured:
    """Activation peaks (bytes autograd keeps, each storage once) of one process and of every rank per P."""

    one_process: int
    tiles: dict[int, list[int]]          # P -> the peak of each of the P tile ranks

    def ratio(self, parts: int) -> float:
        """The largest tile rank's peak over one process's."""
        return max(self.tiles[parts]) / self.one_process

    def within_bound(self, parts: int) -> bool:
        return self.ratio(parts) <= BOUND / parts

    def lines(self, what: str) -> list[str]:
        """One line per P: largest rank, ratio and the acceptance bound side by side."""
        mib = 2 ** 20
        found = [f"{what}: one process {self.one_process / mib:.1f} MiB of activations"]
        for parts, peaks in self.tiles.items():
            grid = "x".join(map(str, GRIDS[parts]))
            found.append(f"{what}: P={parts} ({grid}) largest rank {max(peaks) / mib:.1f} MiB, ratio "
                         f"{self.ratio(parts):.4f} <= bound 1.15/P = {BOUND / parts:.4f}: "
                         f"{'yes' if self.within_bound(parts) else 'NO'} (ideal 1/P = {1 / parts:.4f})")
        return found


def step_peak(model: nn.Module, x: torch.Tensor) -> int:
    """The activation peak of one forward + backward of ``model`` on ``x`` (loss: the output's sum)."""
    meter = ActivationMeter(exclude=list(model.parameters()))
    with meter:
        out = model(x)
    out.sum().backward()
    return meter.peak


def tile_of(x: torch.Tensor, grid: TileGrid, tile: int) -> torch.Tensor:
    """``tile``'s part of a full ``(N, C, D, H, W)`` volume."""
    extent = grid.extent(tile, x.shape[-3:])
    return x[(..., *(slice(a, b) for a, b in extent))].contiguous()


def measure(ctx: Comm, layers: Callable[[], Sequence[nn.Module]], volume: torch.Tensor,
            counts: Sequence[int] = (2, 4, 8)) -> Measured | None:
    """One process (rank 0) and each P of ``counts`` on ranks 0..P-1 (the others wait: the machine holds one
    volume's activations at a time); every rank calls it, rank 0 returns the peaks (the others None).
    ``layers()`` builds the network (same weights every call); ``volume`` is the same on every rank."""
    groups = {parts: ctx.new_group(range(parts)) if parts < ctx.world_size else None for parts in counts}
    one_process = step_peak(nn.Sequential(*layers()).to(volume.dtype), volume) if ctx.rank == 0 else 0
    ctx.barrier()
    tiles: dict[int, list[int]] = {}
    for parts in counts:
        grid = TileGrid.of_shape(GRIDS[parts])
        peak = 0
        if ctx.rank < parts:
            net = spatialize(copy.deepcopy(nn.Sequential(*layers()).to(volume.dtype)), grid, ctx, groups[parts])
            peak = step_peak(net, tile_of(volume, grid, ctx.rank))
        tiles[parts] = [int(p) for p in ctx.all_gather_object(peak)[:parts]]
    return Measured(one_process, tiles) if ctx.rank == 0 else None
