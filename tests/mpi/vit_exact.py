"""timm vision transformers on tiles equal one process (issue 52's first acceptance block, a MAP head), and refusals.

Float64, batch 2, timm's own initialisation (seeded) with LayerScale, class/register tokens and position
embeddings redrawn at unit scale (so the blocks and the prefix tokens matter to the output), in training mode:
output, input gradient, every parameter gradient (tile shares summed by ``reduce_tile_gradients``), then an eval
forward; the output is the model's output on every rank, bitwise equal across ranks. Each model's serial
reference runs on one rank (model i on rank i mod 4). Models are built with ``depth=2`` (the same block code as
at full depth, 12-14 blocks); ``MPI4DL_VIT_FULL_DEPTH=1`` builds them at full depth.

The hybrid (R26 backbone, stride 32, on tiles with halos) runs at 256 px, batch 1 (8x8 tokens; 448 px, batch 2
at full depth).

Usage: python -m tests.mpi.vit_exact   (4 ranks: the 2x2 and the 1x4 grid in one launch)
Named checks: ``check_names()``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tiles import scatter_tiles
from tests.support.checks import Checks, run_checks
from tests.support.exactness import check_spatial_exact

RTOL = 1e-10
FULL_DEPTH = os.environ.get("MPI4DL_VIT_FULL_DEPTH") == "1"


GRIDS = ((2, 2), (1, 4))
HYBRID_SIZE, HYBRID_BATCH = (448, 2) if FULL_DEPTH else (256, 1)


def models(rows: int, cols: int) -> dict[str, tuple[str, int, dict[str, Any]]]:
    """Check label -> (timm name, image size, create_model keywords) for the grid ``rows x cols``."""
    patch16 = 224 if (rows, cols) == (2, 2) else 256
    dinov2: dict[str, Any] = {"img_size": 224} if (rows, cols) == (2, 2) else \
        {"img_size": 518, "dynamic_img_size": True}   # 37x37 position embedding resampled to 16x16
    learned_rope = {} if (rows, cols) == (2, 2) else {   # a learned rope (RotaryEmbeddingMixed, float32 inside)
        "vit_small_patch16_rope_mixed_224": ("vit_small_patch16_rope_mixed_224", 256, {"img_size": 256})}
    return {
        **learned_rope,
        "vit_small_patch16_224": ("vit_small_patch16_224", patch16, {"img_size": patch16}),
        "vit_little_patch16_reg4_gap_256": ("vit_little_patch16_reg4_gap_256", 256, {"num_classes": 0}),
        "vit_small_patch14_reg4_dinov2": ("vit_small_patch14_reg4_dinov2", 224, dinov2),
        "vit_small_patch16_rope_224": ("vit_small_patch16_rope_224", patch16, {"img_size": patch16}),
        "vit_small_patch16_224 with a MAP head": ("vit_small_patch16_224", patch16,
                                                  {"img_size": patch16, "global_pool": "map"}),
        "vit_small_r26_s32_224": ("vit_small_r26_s32_224", HYBRID_SIZE, {"img_size": HYBRID_SIZE}),
    }


def build(name: str, seed: int, **kwargs: Any) -> torch.nn.Module:
    import timm

    torch.manual_seed(seed)
    depth = {} if FULL_DEPTH else {"depth": 2}
    model = timm.create_model(name, pretrained=False, num_classes=kwargs.pop("num_classes", 10), **depth, **kwargs)
    model = model.double()
    with torch.no_grad():   # unit-scale LayerScale, prefix tokens and position embeddings
        for pname, p in model.named_parameters():
            if pname.endswith(("gamma", "gamma_1", "gamma_2")) or pname in ("cls_token", "reg_token", "pos_embed",
                                                                              "attn_pool.latent"):
                p.copy_(torch.rand_like(p) + 0.5 if "gamma" in pname else torch.randn_like(p))
    return model


def exact_name(rows: int, cols: int, model: str) -> str:
    return f"{rows}x{cols}: {model} equals one process"


Call = Callable[[torch.nn.Module, torch.Tensor], object]
REFUSALS: dict[str, tuple[Callable[[int, int], torch.nn.Module], str, Call | None]] = {}


def refusal(label: str, needle: str, call: Call | None = None) -> Callable[..., Any]:
    """Register a model refused by ``spatialize`` (or, with ``call``, at its first forward on 256 x 256 px)."""
    def register(make: Callable[[int, int], torch.nn.Module]) -> Callable[[int, int], torch.nn.Module]:
        REFUSALS[label] = (make, needle, call)
        return make
    return register


@refusal("a grid that cuts a patch", "sizes that work")
def _cut(rows: int, cols: int) -> torch.nn.Module:
    return build("vit_small_patch16_224", 0, img_size=240 if rows == 2 else 224)   # 15 or 14 tokens: uneven


@refusal("a max pool over the tokens (global_pool='max')", "global_pool='max'")
def _max(rows: int, cols: int) -> torch.nn.Module:
    return build("vit_small_patch16_224", 0, img_size=256, global_pool="max")


@refusal("a block whose attention mixes tokens otherwise (ParallelScalingBlock)", "blocks.0",
         lambda net, x: net(x))
def _parallel(rows: int, cols: int) -> torch.nn.Module:
    from timm.models.vision_transformer import ParallelScalingBlock

    return build("vit_small_patch16_224", 0, img_size=256, block_fn=ParallelScalingBlock)


@refusal("an attention mask", "attn_mask",
         lambda net, x: net(x, attn_mask=torch.ones(1, 1, 257, 257, dtype=torch.bool)))
def _masked(rows: int, cols: int) -> torch.nn.Module:
    return build("vit_small_patch16_224", 0, img_size=256)


@refusal("DeiT's distilled ViT (a subclass with its own forward)", "VisionTransformerDistilled")
def _distilled(rows: int, cols: int) -> torch.nn.Module:
    return build("deit_tiny_distilled_patch16_224", 0, img_size=256)


@refusal("BEiT (another transformer class: its patch embedding)", "'patch_embed' (PatchEmbed)")
def _beit(rows: int, cols: int) -> torch.nn.Module:
    return build("beit_base_patch16_224", 0, img_size=256)


def refusal_name(rows: int, cols: int, label: str) -> str:
    return f"{rows}x{cols}: refuses {label}"


def check_names() -> list[str]:
    return [exact_name(rows, cols, m) for rows, cols in GRIDS for m in models(rows, cols)] + \
        [refusal_name(rows, cols, label) for rows, cols in GRIDS for label in REFUSALS]


def check_model(ctx: Context, grid: TileGrid, index: int, name: str, size: int, kwargs: dict[str, Any]) -> str:
    """One model on ``grid`` against one process (on rank ``index`` mod 4); the outputs bitwise equal on every rank."""
    model = build(name, index, **kwargs)
    torch.manual_seed(100 + index)
    x = torch.randn(HYBRID_BATCH if "r26" in name else 2, 3, size, size, dtype=torch.float64)
    errors = check_spatial_exact(model, grid, x, ctx, what=name, rtol=RTOL, grad_floor=1e-6,
                                 reference_rank=index % ctx.world_size)
    net = spatialize(model.eval(), grid, ctx)
    with torch.no_grad():
        y = net(scatter_tiles(x, grid, ctx))
    spread = ctx.all_reduce((y - ctx.all_reduce(y.clone()) / ctx.world_size).abs().max().reshape(1))
    assert float(spread) == 0.0, f"outputs differ across ranks by {float(spread):.1e}"
    compared = {k: v for k, v in errors.items() if k != "gradients and buffers equal on every rank"}
    return (f"worst rel err {max(compared.values()):.2e} over {len(compared)} tensors (output {errors['output']:.1e})"
            if compared else "compared on another rank; outputs equal on every rank")


def check_refusal(ctx: Context, grid: TileGrid, label: str) -> str:
    make, needle, call = REFUSALS[label]
    try:
        net = spatialize(make(grid.rows, grid.cols), grid, ctx)
        if call is not None:
            call(net, scatter_tiles(torch.zeros(1, 3, 256, 256, dtype=torch.float64), grid, ctx))
    except ConfigError as error:
        assert needle in str(error), f"{needle!r} not in: {error}"
        return str(error)[:200]
    raise AssertionError("not refused")


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = Context()
    assert ctx.world_size == 4, "run with 4 ranks"
    for rows, cols in GRIDS:
        grid = TileGrid(rows, cols)
        for index, (label, (name, size, kwargs)) in enumerate(models(rows, cols).items()):
            with check(exact_name(rows, cols, label)) as result:
                result.detail = check_model(ctx, grid, index, name, size, kwargs)
        for label in REFUSALS:
            with check(refusal_name(rows, cols, label)) as result:
                result.detail = check_refusal(ctx, grid, label)
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
