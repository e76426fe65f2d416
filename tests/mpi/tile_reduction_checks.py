"""Tile gradients summed during backward (``TileReduction``, issue 67) equal one all-reduce, bit for bit in float64.

Usage: mpiexec -n 2 python -m tests.mpi.tile_reduction_checks
A small timm ViT (ring attention, a position table whose backward all-reduces on the tile group) and a CNN with
BatchNorm (all-reduces in every BatchNorm backward) on 1x2 tiles, three steps each: the net with the overlapped
reduction against a twin with ``overlap=False``; then two backwards before one reduction, a ``zero_grad`` between a
backward and the reduction, and a backward of the shared parameters outside the net on rank 0 only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.spatial import tile_reduction
from mpi4dl_nb.spatial.convert import reduce_tile_gradients
from mpi4dl_nb.spatial.tile_reduction import TileReduction
from tests.support.checks import Checks, run_checks

GRID = dl.TileGrid(rows=1, cols=2)
SIZE = 32
BUCKET_MB = 2e-3     # 2 kB buckets: many, posted between the backward's own collectives


def vit() -> nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", img_size=SIZE, patch_size=8, embed_dim=32, num_heads=2, depth=2,
                             num_classes=3).double().train()


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1)).double()


MODELS: dict[str, Callable[[], nn.Module]] = {"ViT": vit, "CNN with BatchNorm": cnn}
SCENARIOS = ("three steps", "two backwards, one reduction", "zero_grad before the reduction",
             "a backward outside the net on rank 0")


def check_name(model: str, scenario: str) -> str:
    return f"{model}, {scenario}: overlapped reduction equals one all-reduce bit for bit (float64)"


def check_names() -> list[str]:
    return [check_name(m, s) for m in MODELS for s in SCENARIOS]


def backward(net: nn.Module, tile: torch.Tensor, seed: int) -> None:
    out = net(tile)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    (out * weights).sum().backward()


def step(net: nn.Module, model: nn.Module, tile: torch.Tensor, scenario: str, seed: int, ctx: Context,
         overlap: bool) -> None:
    """One step of ``scenario``: backward(s) of ``net`` (and of ``model`` itself on rank 0), then the reduction."""
    model.zero_grad(set_to_none=True)
    backward(net, tile, seed)
    if scenario == "two backwards, one reduction":
        backward(net, tile, seed + 100)
    elif scenario == "zero_grad before the reduction":
        model.zero_grad(set_to_none=True)
        backward(net, tile, seed + 200)
    elif scenario == "a backward outside the net on rank 0":
        if ctx.rank == 0:   # the plain model's gradients land on the shared parameters, posted on rank 0 only
            full = torch.randn(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
            model(full).sum().backward()
        model.zero_grad(set_to_none=True)
        backward(net, tile, seed + 300)
    reduce_tile_gradients(net, overlap=overlap)


def check(ctx: Context, make: Callable[[], nn.Module], scenario: str) -> str:
    x = torch.randn(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    models = [make(), make()]
    nets = [dl.spatialize(m, GRID, ctx) for m in models]
    tile = dl.scatter_tiles(x, GRID, ctx)
    compared, early = 0, 1 << 30
    for seed in range(3):
        for net, model, overlap in zip(nets, models, (True, False)):
            step(net, model, tile, scenario, seed, ctx, overlap)
        reduction = nets[0].__dict__.get("tile_reduction")
        assert isinstance(reduction, TileReduction), "the overlap was not armed"
        if seed:
            early = min(early, reduction.posted_in_backward)
        assert "tile_reduction" not in nets[1].__dict__
        for (name, got), want in zip(models[0].named_parameters(), models[1].parameters()):
            mine, theirs = got.grad, want.grad
            assert (mine is None) == (theirs is None), name
            if mine is not None and theirs is not None:
                assert torch.equal(mine, theirs), f"step {seed}, {name}: {float((mine - theirs).abs().max()):.3e}"
                compared += 1
    assert early > 1, f"{early} buckets posted during backward"
    return f"{compared} gradients equal over 3 steps; {len(reduction.buckets)} buckets, {early} or more posted " \
           f"during backward"


def main(check_: Checks) -> None:
    torch.set_num_threads(1)
    ctx = Context()
    assert ctx.world_size == 2, "run with 2 ranks"
    default, tile_reduction.TILE_BUCKET_MB = tile_reduction.TILE_BUCKET_MB, BUCKET_MB
    for model, make in MODELS.items():
        for scenario in SCENARIOS:
            with check_(check_name(model, scenario)) as result:
                result.detail = check(ctx, make, scenario)
    tile_reduction.TILE_BUCKET_MB = default
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
