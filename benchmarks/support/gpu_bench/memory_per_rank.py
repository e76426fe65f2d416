"""Row (b), memory per rank: the peak allocator bytes of a ViT training step (SGD with momentum, float32, batch 1) on
1, 2 and 4 ranks as token tiles (mpi plane; 1x2 and 2x2 grids), against the planner's prediction for the same
layout: measured / predicted per rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mpi4dl_nb import ParallelConfig, planner
from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.comm.protocol import Comm
from mpi4dl_nb.config import SliceMethod
from mpi4dl_nb.measure.steps import measure_step_memory
from mpi4dl_nb.models.vit import token_pieces
from mpi4dl_nb.spatial.convert import reduce_tile_gradients, spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tiles import scatter_tiles

from ..world import require_world
from .arguments import int_list, noted, row_parser
from .report import report

PARTS = (1, 2, 4)
BOUND = 0.25            # measured / predicted within 1 +- BOUND on every rank passes
GIB, MIB = 2.0 ** 30, 2.0 ** 20


def config(parts: int) -> ParallelConfig:
    """One spatial stage on ``parts`` token tiles (1x2, 2x2), or one process."""
    return ParallelConfig(split_size=1, spatial_size=int(parts > 1), num_spatial_parts=parts,
                          slice_method=SliceMethod.SQUARE if parts != 2 else SliceMethod.VERTICAL)


def build(name: str, side: int, depth: int, device: torch.device | str) -> nn.Module:
    """timm's ``name`` for ``side`` px images, 2 classes, ``depth`` blocks (0: all), made on ``device``."""
    import timm

    torch.manual_seed(0)
    extra: dict[str, Any] = {"depth": depth} if depth else {}
    with torch.device(device):
        model: nn.Module = timm.create_model(name, img_size=side, num_classes=2,
                                             weight_init="skip" if str(device) == "meta" else "", **extra)
    return model


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Point:
    """One image side on ``parts`` ranks."""

    name: str
    depth: int
    side: int
    parts: int

    def predicted(self, device: torch.device) -> list[int]:
        """The planner's peak per rank, less the engine's gradient buckets (tile gradients summed here without)."""
        layers = token_pieces(build(self.name, self.side, self.depth, "meta"))
        plan = planner.estimate_memory(layers, config(self.parts), self.side, 1, optimizer=sgd, device=device.type)
        print(f"planner, {self.side} px on {self.parts} rank(s):\n{plan.table()}", flush=True)
        return [rank.total - rank.buckets for rank in plan.ranks]

    def measured(self, ctx: Context) -> int | None:
        """This rank's peak bytes of one step after a warm-up step (None: not one of the point's ranks).
        Collective over the world."""
        group = ctx.new_group(range(self.parts)) if self.parts > 1 else None
        if ctx.rank >= self.parts:
            return None
        model = build(self.name, self.side, self.depth, ctx.device)
        image = torch.randn(1, 3, self.side, self.side, device=ctx.device)
        net, x = model, image
        if group is not None:
            grid = TileGrid.from_slice_method(config(self.parts).slice_method, self.parts)
            net, x = spatialize(model, grid, ctx, group), scatter_tiles(image, grid, ctx, group)
        label, optimizer = torch.tensor([1], device=ctx.device), sgd(model.parameters())

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), label).backward()
            if group is not None:
                reduce_tile_gradients(net, shared_memory=False)
            optimizer.step()

        return measure_step_memory(step, [model], optimizer, device=ctx.device, warmup=step)


def predictions(ctx: Comm, points: list[Point], device: torch.device) -> dict[Point, list[int]]:
    """Every point's prediction, the points shared out over the ranks (collective)."""
    mine = {point: point.predicted(device) for point in points[ctx.rank::ctx.world_size]}
    found: dict[Point, list[int]] = {}
    for part in ctx.all_gather_object(mine):
        found.update(part)
    return found


def cell(point: Point, measured: list[int], predicted: list[int]) -> tuple[str, bool]:
    """``P=2 3.1/3.0 GiB (1.03)``: the largest rank's measured / predicted and the ratio furthest from 1."""
    ratios = [m / p for m, p in zip(measured, predicted)]
    worst = max(ratios, key=lambda r: abs(r - 1))
    unit, name = (GIB, "GiB") if max(measured) >= GIB else (MIB, "MiB")
    return (f"P={point.parts} {max(measured) / unit:.2f}/{max(predicted) / unit:.2f} {name} ({worst:.2f})",
            abs(worst - 1) <= BOUND)


def main() -> None:
    parser = row_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--depth", type=int, default=0, help="blocks (0: all)")
    parser.add_argument("--sides", type=int_list, required=True)
    args = parser.parse_args()
    ctx = Context(backend="mpi", device=args.device)
    require_world(ctx, max(PARTS), "memory per rank")
    points = [Point(args.model, args.depth, side, parts) for side in args.sides for parts in PARTS]
    planned = predictions(ctx, points, ctx.device)
    cells, within = [], True
    for point in points:
        found = ctx.all_gather_object(point.measured(ctx))
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()     # the ranks share one GPU: what a point cached goes back before the next
        if ctx.rank == 0:
            print(f"{point.side} px P={point.parts}: measured {found}, predicted {planned[point]}", flush=True)
        text, close = cell(point, [m for m in found if m is not None], planned[point])
        cells.append(f"{point.side}² {text}" if point.parts == 1 else text)
        within = within and close
    if ctx.rank == 0:
        depth = f" depth {args.depth}" if args.depth else ""
        report(within, noted(args.note, f"{args.model}{depth}, measured/predicted, largest rank (ratio furthest from "
                                        f"1, bound {BOUND:.0%}): {'; '.join(cells)}"))


if __name__ == "__main__":
    main()
