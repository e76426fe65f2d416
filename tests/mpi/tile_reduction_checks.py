"""Tile gradients summed during backward (``TileReduction``) and through the node's shared memory (``NodeReduction``,
issue 67) equal one all-reduce, bit for bit in float64.

Usage: mpiexec -n 2 python -m tests.mpi.tile_reduction_checks
A small timm ViT (ring attention, a position table whose backward all-reduces on the tile group) and a CNN with
BatchNorm (all-reduces in every BatchNorm backward) on 1x2 tiles, three steps each: the net with the overlapped
reduction (``shared_memory=False``), and one with the default (the node's shared memory: both ranks share this
node), each against a twin with ``overlap=False, shared_memory=False``; then two backwards before one reduction, a
``zero_grad`` between a backward and the reduction, a backward of the shared parameters outside the net on rank 0
only, and the gradients changed in place after their hooks ran. The shared-memory sum writes into the ``.grad``
tensors in place and copies most of them during the backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.spatial import tile_reduction
from mpi4dl_nb.spatial.convert import reduce_tile_gradients
from mpi4dl_nb.spatial.node_reduction import NodeReduction
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
             "a backward outside the net on rank 0", "the gradients halved in place before the reduction")
WAYS = {"overlapped reduction": False, "shared-memory reduction": True}     # way -> shared_memory


def check_name(model: str, scenario: str, way: str = "overlapped reduction") -> str:
    return f"{model}, {scenario}: {way} equals one all-reduce bit for bit (float64)"


INTERLEAVED = ("ViT, two nets on the same tiles summed through one window, each backward before either sum: "
               "equal to one all-reduce each, bit for bit (float64)")


def check_names() -> list[str]:
    return [*(check_name(m, s, w) for w in WAYS for m in MODELS for s in SCENARIOS), INTERLEAVED]


def backward(net: nn.Module, tile: torch.Tensor, seed: int) -> None:
    out = net(tile)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    (out * weights).sum().backward()


def step(net: nn.Module, model: nn.Module, tile: torch.Tensor, scenario: str, seed: int, ctx: Context,
         overlap: bool, shared_memory: bool) -> int:
    """One step of ``scenario``: backward(s) of ``net`` (and of ``model`` itself on rank 0), then the reduction;
    returns how many gradients the shared-memory reduction had copied before it was asked to sum."""
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
    elif scenario == "the gradients halved in place before the reduction":
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)
    on_node = net.__dict__.get("node_reduction")
    copied = len(on_node.writes.copied) if isinstance(on_node, NodeReduction) else 0
    before = {name: p.grad for name, p in model.named_parameters()}
    reduce_tile_gradients(net, overlap=overlap, shared_memory=shared_memory)
    if shared_memory:
        for name, p in model.named_parameters():
            assert p.grad is before[name], f"{name}: the shared-memory sum replaced the .grad tensor"
    return copied


def same_gradients(model: nn.Module, twin: nn.Module, seed: int) -> int:
    """Assert ``model``'s gradients equal ``twin``'s bit for bit (missing on both alike); how many were compared."""
    compared = 0
    for (name, got), want in zip(model.named_parameters(), twin.parameters()):
        mine, theirs = got.grad, want.grad
        assert (mine is None) == (theirs is None), name
        if mine is not None and theirs is not None:
            assert torch.equal(mine, theirs), f"step {seed}, {name}: {float((mine - theirs).abs().max()):.3e}"
            compared += 1
    return compared


def check(ctx: Context, make: Callable[[], nn.Module], scenario: str, shared_memory: bool) -> str:
    x = torch.randn(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    models = [make(), make()]
    nets = [dl.spatialize(m, GRID, ctx) for m in models]
    tile = dl.scatter_tiles(x, GRID, ctx)
    compared, early = 0, 1 << 30
    for seed in range(3):
        copied = step(nets[0], models[0], tile, scenario, seed, ctx, True, shared_memory)
        step(nets[1], models[1], tile, scenario, seed, ctx, False, False)
        if seed:
            early = min(early, copied if shared_memory else posted_in_backward(nets[0]))
        assert "tile_reduction" not in nets[1].__dict__ and "node_reduction" not in nets[1].__dict__
        compared += same_gradients(models[0], models[1], seed)
    assert early > 1, f"{early} buckets posted or gradients copied during backward"
    if shared_memory:
        reduction = nets[0].__dict__.get("node_reduction")
        assert isinstance(reduction, NodeReduction), "the shared-memory reduction was not armed"
        assert "tile_reduction" not in nets[0].__dict__
        return f"{compared} gradients equal over 3 steps; {early} or more of {len(reduction.params)} copied " \
               f"during backward, the sums written into the .grad tensors in place"
    return f"{compared} gradients equal over 3 steps; {len(tile_reduction_of(nets[0]).buckets)} buckets, {early} " \
           f"or more posted during backward"


def check_interleaved(ctx: Context) -> str:
    """Nets A and B share the node's window: A's hooks copy into it, B's backward and sum overwrite it, then A's
    sum must copy its gradients again; their twins sum by one all-reduce each."""
    x = torch.randn(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    models = [vit() for _ in range(4)]                   # A, B through the window; A', B' by the all-reduce
    nets = [dl.spatialize(m, GRID, ctx) for m in models]
    tile = dl.scatter_tiles(x, GRID, ctx)
    compared = 0
    for seed in range(3):
        for pair, shared_memory in ((nets[:2], True), (nets[2:], False)):
            for net in pair:
                net.zero_grad(set_to_none=True)
            backward(pair[0], tile, seed)
            backward(pair[1], tile, seed + 50)
            for net in reversed(pair):
                reduce_tile_gradients(net, overlap=shared_memory, shared_memory=shared_memory)
        compared += same_gradients(models[0], models[2], seed) + same_gradients(models[1], models[3], seed)
    assert all(isinstance(net.__dict__.get("node_reduction"), NodeReduction) for net in nets[:2])
    return f"{compared} gradients equal over 3 steps"


def tile_reduction_of(net: nn.Module) -> TileReduction:
    reduction = net.__dict__.get("tile_reduction")
    assert isinstance(reduction, TileReduction), "the overlap was not armed"
    return reduction


def posted_in_backward(net: nn.Module) -> int:
    return tile_reduction_of(net).posted_in_backward


def main(check_: Checks) -> None:
    torch.set_num_threads(1)
    ctx = Context()
    assert ctx.world_size == 2, "run with 2 ranks"
    default, tile_reduction.TILE_BUCKET_MB = tile_reduction.TILE_BUCKET_MB, BUCKET_MB
    for way, shared_memory in WAYS.items():
        for model, make in MODELS.items():
            for scenario in SCENARIOS:
                with check_(check_name(model, scenario, way)) as result:
                    result.detail = check(ctx, make, scenario, shared_memory)
    with check_(INTERLEAVED) as result:
        result.detail = check_interleaved(ctx)
    tile_reduction.TILE_BUCKET_MB = default
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
