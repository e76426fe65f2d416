"""Swin-T on 2x2 tiles against one process: activation bytes per rank, and the bytes each shifted-window block sends
against that block's activations on its tile.

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/bench_swin.py                   # Swin-T at 1024 px
    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/bench_swin.py --depths 2,2,2,2   # lighter (one process: 1.7 GB)
    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/bench_swin.py --grid 1x2         # P = 2

timm's ``swin_tiny_patch4_window7_224`` built for ``--size`` (img_size=, width 96, float32, batch 1, training mode,
no stochastic depth), ``dl.spatialize``-d on a 2x2 grid (``--grid RxC``: another). Activation bytes: what autograd
saves for backward plus the output (each storage once, weights left out: ``support/memory.py``), one forward; one
process on rank 0 first, then every rank's tile; the largest rank's share of one process against the 1.15/P bound.
Bytes sent per shifted block: the tokens its two gathers move (into this tile's windows and back; the plan's exact
message sizes) x width x 4 bytes, forward (backward sends the same again), on the rank that sends most, against that
block's activation bytes on that rank (forward and backward pre/post hooks around each block).
"""

from __future__ import annotations

import argparse
import faulthandler
from contextlib import AbstractContextManager

import torch
from support.machine import Footer
from support.memory import SavedBytes
from support.tables import Table
from support.world import require_world
from torch import nn

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tiles import scatter_tiles
from mpi4dl_nb.spatial.windows.swin import WindowBlock


def build(size: int, depths: tuple[int, ...]) -> nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=size, depths=depths,
                             drop_path_rate=0.0)


def forward_bytes(model: nn.Module, x: torch.Tensor, counter: SavedBytes | None = None) -> int:
    """Activation bytes of one forward (saved for backward + output), the weights left out (``counter``: the one
    that block counters pass their tensors on to)."""
    counter = counter or SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        out = model(x)
    counter.add(out)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(size for pointer, size in counter.storages.items() if pointer not in weights)


class BlockBytes:
    """Per block of a spatialized Swin: its activation bytes on this tile (saved tensors inside its forward)."""

    def __init__(self, net: nn.Module, outer: SavedBytes) -> None:
        self.outer = outer   # the whole forward's counter: inner saved-tensor hooks hide tensors from outer ones
        self.bytes: dict[str, int] = {}
        self._open: list[tuple[SavedBytes, AbstractContextManager[None]]] = []
        for name, module in net.named_modules():
            if isinstance(module, WindowBlock):
                module.register_forward_pre_hook(self._enter)
                module.register_forward_hook(lambda m, a, out, n=name: self._leave(n, out))

    def _enter(self, module: nn.Module, args: tuple[object, ...]) -> None:
        counter = SavedBytes()

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            self.outer.pack(tensor)
            return counter.pack(tensor)

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        hooks.__enter__()
        self._open.append((counter, hooks))

    def _leave(self, name: str, out: torch.Tensor) -> None:
        counter, hooks = self._open.pop()
        hooks.__exit__(None, None, None)
        counter.add(out)
        self.bytes[name] = counter.total


def block_traffic(net: nn.Module) -> dict[str, tuple[int, int, int]]:
    """Shifted blocks of this tile: name -> (tokens sent forward, width, straddling windows computed here)."""
    runtime = net.spatial_runtime
    rows: dict[str, tuple[int, int, int]] = {}
    for name, module in net.named_modules():
        if isinstance(module, WindowBlock) and any(module.shift_size):
            sizes, window = tuple(module.input_resolution), tuple(module.window_size)
            plan = runtime.plans[("swin windows", sizes, window, tuple(module.shift_size))]
            sent = plan.into.plan.tokens_sent + plan.back.plan.tokens_sent
            rows[name] = (sent, int(module.norm1.normalized_shape[0]), plan.into.plan.tokens_received)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--depths", default="2,2,6,2")
    parser.add_argument("--grid", default="2x2", help="tile rows x columns, e.g. 1x2 (mpiexec -n rows*cols)")
    args = parser.parse_args()
    depths = tuple(int(d) for d in args.depths.split(","))
    footer = Footer()
    torch.set_num_threads(1)
    ctx = Context()
    rows, cols = (int(n) for n in args.grid.split("x"))
    grid = TileGrid(rows, cols)
    require_world(ctx, grid.num_tiles, "bench_swin")
    torch.manual_seed(1)
    x = torch.randn(1, 3, args.size, args.size)
    serial = forward_bytes(build(args.size, depths).train(), x) if ctx.rank == 0 else 0
    ctx.barrier()
    net = spatialize(build(args.size, depths).train(), grid, ctx)
    outer = SavedBytes()
    per_block = BlockBytes(net, outer)
    mine = forward_bytes(net, scatter_tiles(x, grid, ctx), outer)
    traffic = block_traffic(net)
    everyone = ctx.all_gather_object((mine, traffic, per_block.bytes))
    if ctx.rank == 0:
        report(args.size, depths, grid, serial, everyone)
        footer.print()


def report(size: int, depths: tuple[int, ...], grid: TileGrid, serial: int,
           everyone: list[tuple[int, dict[str, tuple[int, int, int]], dict[str, int]]]) -> None:
    largest = max(mine for mine, _, _ in everyone)
    print(f"Swin-T (depths {depths}, width 96) at {size}², float32, batch 1, {grid.rows}x{grid.cols} tiles: "
          f"activation bytes of one forward (saved for backward + output)")
    table = Table(["", ">MB", ">share of one process", ">bound"])
    table.add("one process", f"{serial / 2**20:.1f}", "1.000", "")
    table.add("largest rank", f"{largest / 2**20:.1f}", f"{largest / serial:.3f}", f"{1.15 / grid.num_tiles:.3f}")
    print(table.markdown())
    print("\nshifted-window blocks: bytes sent forward (into the windows and back; backward the same) by the rank "
          "sending most, against that block's activations on that rank")
    table = Table(["block", ">tokens received into windows", ">KB sent", ">block activations MB",
                   ">sent / activations"])
    for name in everyone[0][1]:
        rank = max(range(len(everyone)), key=lambda r: everyone[r][1][name][0])
        sent, width, received = everyone[rank][1][name]
        activations = everyone[rank][2][name]
        table.add(name, str(received), f"{sent * width * 4 / 1024:.0f}", f"{activations / 2**20:.1f}",
                  f"{sent * width * 4 / activations:.2%}")
    print(table.markdown())


if __name__ == "__main__":
    faulthandler.enable()
    main()
