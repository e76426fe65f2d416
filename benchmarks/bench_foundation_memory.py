"""Foundation-model ViTs on token tiles (issue 66): the largest rank's activation bytes per block and per step,
measured beside the planner's estimate, and the planner's largest image per P for a 16 GB and an 80 GB per-rank budget.

    OMP_NUM_THREADS=1 MPIR_CVAR_ENABLE_HEAVY_YIELD=1 mpiexec -n 4 python benchmarks/bench_foundation_memory.py \\
        --measure L:1024,L:2048,H:1024,H:2048,g:1024,g:2048        # BENCHMARKS.md section 18: 13 min here

Models: timm ``vit_large_patch16_224`` (L: width 1024, 24 blocks), ``vit_huge_patch14_224`` (H: 1280, 32) and
``vit_giant_patch14_dinov2`` (g: 1536, 40, SwiGLU), built at ``img_size`` = the image side, 2 classes, float32,
batch 1. Tiles: P = 2 a 1x2 grid, P = 4 2x2 (rank 0 also holds the class token).

Measured (the ``--measure`` points, model:side): one block of the model (timm's own, depth 1) on each rank's tokens,
forward on real tensors; the bytes autograd saves for backward (each storage once, weights left out; the block's
input included, its output not: that is the next block's input), on the largest rank. P = 1: the block as one
process runs it (timm's fused attention: torch's flash kernel for CPU); P = 2, 4: its attention as
``ring_attention`` over the P ranks (``bench_vit.TokenAttention``). Recomputation on: the block as a segment of the
engine's ``checkpointed(..., 'every')`` (it keeps only its input). Per step (derived, not run): depth x the block
+ the patch embedding and head (measured in one process, times the rank's share of the tokens); with
recomputation depth x its kept input + one block's activations besides it (the segment recomputed in its backward).
Planner: the per-block footprint on the largest rank (``simulate_layer``: kept + saved input) and, per step, the
activation terms (activations, boundary, recompute) of the largest rank's peak in ``estimate_memory`` of the
full-depth model (built on ``meta``; AdamW: 2 optimizer states; recomputation: ``checkpoint_activations='every'``;
the CPU's attention kernels). Largest image: ``planner.memory.largest_side`` on the planner's peak (weights,
gradients, optimizer, buckets and activations), sides in multiples of 2 patches. Points not measured print the
planner's figures alone.
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from bench_vit import TokenAttention, activation_bytes, ring_of
from support.machine import Footer
from support.tables import Table
from support.world import require_world
from torch import nn

from mpi4dl_nb import ParallelConfig, planner
from mpi4dl_nb.comm.allocator import release_free_heap
from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.config import CheckpointGranularity, SliceMethod
from mpi4dl_nb.models.vit import patch_grid_of, patch_multiple, token_pieces
from mpi4dl_nb.pipeline.recompute import checkpointed
from mpi4dl_nb.planner.attention import TokenGrid
from mpi4dl_nb.planner.footprint import StageRole
from mpi4dl_nb.planner.memory import MemoryPlan, largest_side
from mpi4dl_nb.planner.tile_footprints import simulate_layer
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tokens.ring import ring_attention

MODELS = {"L": ("ViT-L/16", "vit_large_patch16_224"), "H": ("ViT-H/14", "vit_huge_patch14_224"),
          "g": ("ViT-g/14", "vit_giant_patch14_dinov2")}
PARTS = (1, 2, 4)
BUDGETS_GB = (16, 80)
ACTIVATION_TERMS = ("activations", "boundary", "recompute")
MB, GB = 2.0 ** 20, 1e9


def make_vit(key: str, side: int, depth: int | None = None, meta: bool = False) -> nn.Module:
    """timm's model ``key`` built for ``side`` px images, 2 classes (``depth`` blocks; None: all), on meta or CPU."""
    import timm

    torch.manual_seed(0)
    extra: dict[str, Any] = {} if depth is None else {"depth": depth}
    with torch.device("meta" if meta else "cpu"):                 # meta: shapes only, for the planner
        model: nn.Module = timm.create_model(MODELS[key][1], img_size=side, num_classes=2,
                                             weight_init="skip" if meta else "", **extra)
    return model


def tokens_of(model: nn.Module) -> TokenGrid:
    return TokenGrid(*patch_grid_of(model), prefix=int(vars(model)["num_prefix_tokens"]))


def width_of(model: nn.Module) -> int:
    return int(vars(model)["embed_dim"])


def blocks_of(model: nn.Module) -> list[nn.Module]:
    return list(model.get_submodule("blocks").children())


def config(parts: int, recompute: bool) -> ParallelConfig:
    return ParallelConfig(split_size=1, spatial_size=int(parts > 1), num_spatial_parts=parts,
                          slice_method=SliceMethod.SQUARE if parts == 4 else SliceMethod.VERTICAL,
                          checkpoint_activations=CheckpointGranularity.EVERY if recompute else None)


def grid_of(parts: int) -> TileGrid:
    return TileGrid.from_slice_method(config(parts, False).slice_method, parts)


@dataclass
class Point:
    """One model, side and P: the largest rank's bytes, measured (``block`` None: not measured) and planned."""

    key: str
    side: int
    parts: int
    tokens: int = 0
    depth: int = 0
    block: tuple[int, int] | None = None          # measured per block: recomputation off, on
    stem_head: int = 0                            # measured: patch embedding + head, the largest rank's share
    planned_block: tuple[int, int] = (0, 0)
    planned_step: tuple[int, int] = (0, 0)
    peaks: tuple[int, int] = (0, 0)               # the planner's whole peak of the largest rank: off, on

    def measured_step(self) -> tuple[int, int] | None:
        """Derived per step: depth x block + embedding/head; with recomputation the kept inputs and one block's
        activations besides its input (recomputed in its backward)."""
        if self.block is None:
            return None
        off, on = self.block
        return self.depth * off + self.stem_head, self.depth * on + off - on + self.stem_head


def plan(key: str, side: int, parts: int, recompute: bool) -> MemoryPlan:
    """The planner's memory plan of the full-depth model (on ``meta``) at ``side`` px on ``parts`` ranks."""
    layers = token_pieces(make_vit(key, side, meta=True))
    return planner.estimate_memory(layers, config(parts, recompute), side, 1, optimizer_states=2)


def planned(point: Point) -> None:
    """The planner's figures of ``point``: per block (``simulate_layer``, largest tile) and per step."""
    model = make_vit(key=point.key, side=point.side, meta=True)
    tokens = tokens_of(model)
    role = StageRole((grid_of(point.parts).rows, grid_of(point.parts).cols), tokens=tokens) if point.parts > 1 \
        else StageRole()
    tiles = simulate_layer(blocks_of(model)[0], [(1, tokens.total, width_of(model))], torch.float32, role)
    point.tokens, point.depth = tokens.total, len(blocks_of(model))
    point.planned_block = (max(fp.kept + (fp.input_bytes if fp.saves_input else 0) for fp in tiles),
                           max(fp.input_bytes for fp in tiles))
    steps, peaks = [], []
    for recompute in (False, True):
        found = plan(point.key, point.side, point.parts, recompute)
        rank = max(found.ranks, key=lambda r: r.total)
        steps.append(sum(rank.terms[term] for term in ACTIVATION_TERMS))
        peaks.append(found.peak)
    point.planned_step, point.peaks = (steps[0], steps[1]), (peaks[0], peaks[1])


def block_bytes(block: nn.Module, count: int, width: int) -> tuple[int, int]:
    """What ``block`` saves on ``count`` tokens: as it is, and as a segment of the engine's recomputation."""
    x = torch.randn(1, count, width, requires_grad=True)
    return (activation_bytes(block, x, output=False),
            activation_bytes(checkpointed(nn.Sequential(block), CheckpointGranularity.EVERY), x, output=False))


def measure(ctx: Context, point: Point) -> None:
    """``point``'s measured bytes for P = ``point.parts`` (collective: every rank calls it)."""
    model = make_vit(point.key, point.side, depth=1)
    tokens, width, block = tokens_of(model), width_of(model), blocks_of(model)[0]
    mine = (0, 0)
    if point.parts == 1:
        if ctx.rank == 0:
            mine = block_bytes(block, tokens.total, width)
    else:
        ring, count = ring_of(ctx, point.parts, tokens)
        if ring is not None:
            ringed = copy.deepcopy(block)
            ringed.attn = TokenAttention(ringed.get_submodule("attn"), partial(ring_attention, ring=ring))
            mine = block_bytes(ringed, count, width)
    ctx.barrier()
    found = ctx.all_gather_object(mine)
    point.block = (max(f[0] for f in found), max(f[1] for f in found))
    if ctx.rank == 0:
        pieces = token_pieces(model)
        image = torch.randn(1, 3, point.side, point.side)
        stem = activation_bytes(pieces[0], image, output=False)
        head = activation_bytes(pieces[-1], torch.randn(1, tokens.total, width, requires_grad=True), output=False)
        share = max(tokens.member_tokens(grid_of(point.parts))) / tokens.total
        point.stem_head = round((stem + head) * share)


def cell(measured: int | None, estimate: int, unit: float) -> str:
    digits = 0 if unit == MB else 2
    if measured is None:
        return f"- / {estimate / unit:,.{digits}f} (est.)"
    return f"{measured / unit:,.{digits}f} / {estimate / unit:,.{digits}f} ({estimate / measured:.2f})"


def row(point: Point) -> list[str]:
    name = MODELS[point.key][0]
    step = point.measured_step()
    return [name, f"{point.side}²", f"{point.tokens:,}", str(point.parts),
            *(cell(point.block[i] if point.block else None, point.planned_block[i], MB) for i in (0, 1)),
            *(cell(step[i] if step else None, point.planned_step[i], GB) for i in (0, 1)),
            f"{point.peaks[0] / GB:.1f} / {point.peaks[1] / GB:.1f}"]


COLUMNS = ["model", "image", ">tokens", ">P", ">MB/block, off: measured / planner (ratio)", ">on (held)",
           ">GB/step, off: derived / planner (ratio)", ">on", ">planner peak GB off / on"]


def largest_sides(key: str, parts: int, recompute: bool) -> list[int]:
    """The planner's largest side per budget of ``BUDGETS_GB`` (one memo of peaks for all)."""
    memo: dict[int, int] = {}

    def peak(side: int) -> int:
        if side not in memo:
            memo[side] = plan(key, side, parts, recompute).peak
        return memo[side]

    unit = 2 * patch_multiple(make_vit(key, 224, depth=1, meta=True))
    return [largest_side(peak, budget * GB, unit, probe=1024 // unit) for budget in BUDGETS_GB]


def largest_table(ctx: Context, points: list[Point], keys: list[str]) -> str:
    """The planner's largest image per model, P, budget and recomputation (the searches shared by the ranks), and
    how many measured points agree with it (fit by the peak with measured activations <=> side <= largest)."""
    tasks = [(key, parts, recompute) for key in keys for parts in PARTS for recompute in (False, True)]
    mine = {task: largest_sides(*task) for task in tasks[ctx.rank::ctx.world_size]}
    found: dict[tuple[str, int, bool], list[int]] = {}
    for part in ctx.all_gather_object(mine):
        found.update(part)
    table = Table(["model", ">P", *(f">{b} GB, recompute {r}" for b in BUDGETS_GB for r in ("off", "on"))])
    for key in keys:
        for parts in PARTS:
            sides = [found[(key, parts, r)][b] for b in range(len(BUDGETS_GB)) for r in (False, True)]
            table.add(MODELS[key][0], str(parts), *(f"{s:,} px" if s else "none" for s in sides))
    agree = total = 0
    for point in points:
        step = point.measured_step()
        for r, recompute in enumerate((False, True)):
            if step is None:
                continue
            with_measured = point.peaks[r] - point.planned_step[r] + step[r]
            for b, budget in enumerate(BUDGETS_GB):
                total += 1
                agree += (with_measured <= budget * GB) == (point.side <= found[(point.key, point.parts, recompute)][b])
    return table.markdown() + (f"\n\nat the measured points, the planner's peak with the measured activations in place "
                               f"of its own fits a budget exactly where the side is within the largest: {agree} of "
                               f"{total} (point x recomputation x budget)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", default="L:1024", help="model:side points measured (L, H, g), comma-separated")
    parser.add_argument("--sides", default="1024,2048", help="image sides of the table (px), comma-separated")
    parser.add_argument("--models", default=",".join(MODELS), help="models of both tables (L, H, g), comma-separated")
    args = parser.parse_args()
    footer = Footer()
    torch.set_num_threads(1)
    ctx = Context(backend="gloo")
    require_world(ctx, 4, "bench_foundation_memory")
    wanted = {(k, int(s)) for k, s in (p.split(":") for p in args.measure.split(",") if p)}
    keys = args.models.split(",")
    points = [Point(key, int(side), parts) for key in keys for side in args.sides.split(",") for parts in PARTS]
    if ctx.rank == 0:
        print("largest rank's activation bytes, float32, batch 1 (measured / planner (planner/measured); "
              "est.: not measured here)\n" + Table(COLUMNS).markdown(), flush=True)
    for point in points:
        start = time.perf_counter()
        if (point.key, point.side) in wanted:
            measure(ctx, point)
            release_free_heap()        # under run_all.sh's malloc tuning the freed blocks would stay in the process
        if ctx.rank == 0:
            planned(point)
            print(Table(COLUMNS, [row(point)]).markdown().splitlines()[-1] +
                  (f" <!-- {time.perf_counter() - start:.0f} s -->" if point.block else ""), flush=True)
    table = largest_table(ctx, points, keys)
    if ctx.rank == 0:
        print("\nthe planner's largest square image per rank budget (AdamW, float32, batch 1; sides in 2-patch "
              "steps):\n" + table)
        footer.print()


if __name__ == "__main__":
    main()
