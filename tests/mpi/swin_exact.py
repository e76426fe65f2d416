"""timm's Swin and Swin-V2 on tiles equal one process (issue 53's Swin acceptance), the distributed roll, refusals.

Float64, batch 2 (448 px: batch 1), timm's own initialisation (seeded), in training mode: output, input gradient,
every parameter gradient (tile shares summed by ``reduce_tile_gradients``), then an eval forward; the logits bitwise
equal on every rank. Each model's serial reference runs on one rank (model i on rank i mod 4). Models are built with
``depths=(2, 2, 2, 2)``, ``embed_dim=32`` and 1, 2, 4, 8 heads (every stage has a shifted block; the same block code
as the full models' (2, 2, 6, 2) x 96 with 3, 6, 12, 24 heads); ``MPI4DL_SWIN_FULL=1`` builds them at full size.
Stochastic depth off but in one case (every forward seeded alike: its per-sample draws and the head's dropout equal
one process's). Swin-S3 has windows 7, 7, 14, 7 (stage 3 one 14 x 14 window over the 2x2 tiles).

At 224 px Swin-T's last stage is one 7 x 7 window over all tiles (its merge straddles tiles on 2x2 and 1x4; on 1x4
stage 3's 14 columns over 4 tiles straddle too); at 448 px the last stage is shifted; Swin-V2 (window 8, 256 px)
has its last stage one window over the 2x2 tiles.

The roll: ``DistributedRoll`` on 2x2 and on a 2x1x2 volume grid equals ``torch.roll`` of the whole grid, forward and
gradient.

Usage: python -m tests.mpi.swin_exact [--backend=gloo]   (4 ranks; on gloo: the rolls and one model)
Named checks: ``check_names(backend)``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tiles import gather_tiles, scatter_tiles
from mpi4dl_nb.spatial.windows.exchange import DistributedRoll
from mpi4dl_nb.spatial.windows.plan import TokenBoxes
from tests.support.checks import Checks, run_checks
from tests.support.exactness import exact_and_equal_on_every_rank
from tests.support.planes import split_backend

RTOL = 1e-10
FULL = os.environ.get("MPI4DL_SWIN_FULL") == "1"
SMALL: dict[str, Any] = {} if FULL else {"depths": (2, 2, 2, 2), "embed_dim": 32, "num_heads": (1, 2, 4, 8)}

# label -> (grid, timm name, image size, create_model keywords)
MODELS: dict[str, tuple[tuple[int, int], str, int, dict[str, Any]]] = {
    "2x2: swin_tiny_patch4_window7_224 at 224 px": ((2, 2), "swin_tiny_patch4_window7_224", 224, {}),
    "2x2: swin_tiny_patch4_window7_224 at 448 px": ((2, 2), "swin_tiny_patch4_window7_224", 448, {}),
    "1x4: swin_tiny_patch4_window7_224 at 224 px, stochastic depth and head dropout in training": (
        (1, 4), "swin_tiny_patch4_window7_224", 224, {"drop_path_rate": 0.3, "drop_rate": 0.2}),
    "1x4: swin_tiny_patch4_window7_224 at 448 px": ((1, 4), "swin_tiny_patch4_window7_224", 448, {}),
    "2x2: swinv2_tiny_window8_256 at 256 px": ((2, 2), "swinv2_tiny_window8_256", 256, {}),
    "2x2: swin_s3_tiny_224 (windows 7, 7, 14, 7) at 224 px": ((2, 2), "swin_s3_tiny_224", 224, {}),
}
GLOO_MODELS = ("1x4: swin_tiny_patch4_window7_224 at 224 px, stochastic depth and head dropout in training",)
ROLLS: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {   # grid, token grid, shifts
    "roll on 2x2 tiles equals torch.roll": ((2, 2), (13, 10), (-3, 4)),
    "roll on 2x1x2 volume tiles equals torch.roll": ((2, 1, 2), (5, 6, 7), (2, -3, 3)),
}


def build(name: str, seed: int, **kwargs: Any) -> torch.nn.Module:
    import timm

    torch.manual_seed(seed)
    return timm.create_model(name, pretrained=False, num_classes=10,
                             **{"drop_path_rate": 0.0, **SMALL, **kwargs}).double()


def check_model(ctx: Context, index: int, label: str) -> str:
    """One model against one process (on rank ``index`` mod 4); the logits bitwise equal on every rank."""
    (rows, cols), name, size, kwargs = MODELS[label]
    grid = TileGrid(rows, cols)
    model = build(name, index, img_size=size, **kwargs)
    torch.manual_seed(100 + index)
    x = torch.randn(1 if size > 256 else 2, 3, size, size, dtype=torch.float64)
    return exact_and_equal_on_every_rank(model, grid, x, ctx, what=label, rtol=RTOL, forward_seed=5,
                                         reference_rank=index % ctx.world_size)


def check_roll(ctx: Context, label: str) -> str:
    """``DistributedRoll`` of channels-last tiles against ``torch.roll`` of the whole grid, values and gradient."""
    shape, sizes, shifts = ROLLS[label]
    grid = TileGrid.of_shape(shape)
    boxes = TokenBoxes(grid, sizes)
    torch.manual_seed(7)
    whole = torch.randn(2, 3, *sizes, dtype=torch.float64)   # channels first for scatter_tiles
    weight = torch.randn(2, 3, *sizes, dtype=torch.float64)
    axes = tuple(range(2, 2 + len(sizes)))
    tile = scatter_tiles(whole, grid, ctx).movedim(1, -1).detach().requires_grad_(True)
    roll = DistributedRoll(boxes, shifts, ctx.rank, ctx, list(range(ctx.world_size)))
    rolled = roll(tile)
    (rolled * scatter_tiles(weight, grid, ctx).movedim(1, -1)).sum().backward()
    got = gather_tiles(rolled.detach().movedim(-1, 1).contiguous(), grid, ctx)
    assert torch.equal(got, torch.roll(whole, shifts, dims=axes)), "rolled values differ"
    grad = gather_tiles(tile.grad.movedim(-1, 1).contiguous(), grid, ctx)
    assert torch.equal(grad, torch.roll(weight, tuple(-s for s in shifts), dims=axes)), "roll gradient differs"
    return f"{roll.exchange.plan.tokens_sent} tokens sent by rank {ctx.rank}"


REFUSALS: dict[str, tuple[Callable[[], torch.nn.Module], str, bool]] = {   # make, needle, refused at forward
    "a Swin block outside timm's Swin model": (
        lambda: build("swin_tiny_patch4_window7_224", 0).layers[0].blocks[1], "spatialize the whole model", False),
    "a head without the average pool (global_pool='')": (
        lambda: build("swin_tiny_patch4_window7_224", 0, global_pool=""), "global_pool=''", False),
    "dropout inside the attention in training (attn_drop_rate)": (
        lambda: build("swin_tiny_patch4_window7_224", 0, attn_drop_rate=0.1), "attn_drop_rate=0", True),
    "an image of another size than the model's img_size": (
        lambda: build("swin_tiny_patch4_window7_224", 0, img_size=448), "img_size=", True),
}


def check_refusal(ctx: Context, label: str) -> str:
    make, needle, at_forward = REFUSALS[label]
    grid = TileGrid(2, 2)
    try:
        net = spatialize(make(), grid, ctx)
        if at_forward:
            net(scatter_tiles(torch.zeros(1, 3, 224, 224, dtype=torch.float64), grid, ctx))
    except ConfigError as error:
        assert needle in str(error), f"{needle!r} not in: {error}"
        return str(error)[:160]
    raise AssertionError("not refused")


def check_names(backend: str = "mpi") -> list[str]:
    if backend != "mpi":
        return [f"{backend}: {label}" for label in (*ROLLS, *GLOO_MODELS)]
    return [*ROLLS, *MODELS, *(f"refuses {label}" for label in REFUSALS)]


def main(check: Checks) -> None:
    backend, _ = split_backend(sys.argv[1:])
    torch.set_num_threads(1)
    ctx = Context(backend=backend)
    assert ctx.world_size == 4, "run with 4 ranks"
    prefix = "" if backend == "mpi" else f"{backend}: "
    for label in ROLLS:
        with check(prefix + label) as result:
            result.detail = check_roll(ctx, label)
    for index, label in enumerate(MODELS):
        if backend == "mpi" or label in GLOO_MODELS:
            with check(prefix + label) as result:
                result.detail = check_model(ctx, index, label)
    if backend == "mpi":
        for label in REFUSALS:
            with check(f"refuses {label}") as result:
                result.detail = check_refusal(ctx, label)
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
