"""timm vision transformers on tiles equal one process (issue 52's first acceptance block), and what is refused.

Float64, batch 2, timm's own initialisation (seeded) with LayerScale, class/register tokens and position
embeddings redrawn at unit scale (so the blocks and the prefix tokens matter to the output), in training mode:
output, input gradient, every parameter gradient (tile shares summed by ``reduce_tile_gradients``), then an eval
forward; the output is the model's output on every rank, bitwise equal across ranks. Each model's serial
reference runs on one rank (model i on rank i mod 4). Models are built with ``depth=2`` (the same block code as
at full depth, 12-14 blocks); ``MPI4DL_VIT_FULL_DEPTH=1`` builds them at full depth.

Usage: python -m tests.mpi.vit_exact ROWS COLS
Named checks: ``check_names(rows, cols)``.
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
from mpi4dl_nb.spatial.tiles import scatter_tiles
from tests.support.checks import Checks, run_checks
from tests.support.exactness import check_spatial_exact

RTOL = 1e-10
FULL_DEPTH = os.environ.get("MPI4DL_VIT_FULL_DEPTH") == "1"


def models(rows: int, cols: int) -> dict[str, tuple[str, int, dict[str, Any]]]:
    """Check label -> (timm name, image size, create_model keywords) for the grid ``rows x cols``."""
    patch16 = 224 if (rows, cols) == (2, 2) else 256
    dinov2: dict[str, Any] = {"img_size": 224} if (rows, cols) == (2, 2) else \
        {"img_size": 518, "dynamic_img_size": True}   # 37x37 position embedding resampled to 16x16
    return {
        "vit_small_patch16_224": ("vit_small_patch16_224", patch16, {"img_size": patch16}),
        "vit_little_patch16_reg4_gap_256": ("vit_little_patch16_reg4_gap_256", 256, {"num_classes": 0}),
        "vit_small_patch14_reg4_dinov2": ("vit_small_patch14_reg4_dinov2", 224, dinov2),
        "vit_small_patch16_rope_224": ("vit_small_patch16_rope_224", patch16, {"img_size": patch16}),
        "vit_small_r26_s32_224": ("vit_small_r26_s32_224", 448, {"img_size": 448}),
    }


def build(name: str, seed: int, **kwargs: Any) -> torch.nn.Module:
    import timm

    torch.manual_seed(seed)
    depth = {} if FULL_DEPTH else {"depth": 2}
    model = timm.create_model(name, pretrained=False, num_classes=kwargs.pop("num_classes", 10), **depth, **kwargs)
    model = model.double()
    with torch.no_grad():   # unit-scale LayerScale, prefix tokens and position embeddings
        for pname, p in model.named_parameters():
            if pname.endswith(("gamma", "gamma_1", "gamma_2")) or pname in ("cls_token", "reg_token", "pos_embed"):
                p.copy_(torch.rand_like(p) + 0.5 if "gamma" in pname else torch.randn_like(p))
    return model


def exact_name(model: str) -> str:
    return f"{model} equals one process"


REFUSALS: dict[str, tuple[Callable[[int, int], torch.nn.Module], str, bool]] = {}


def refusal(label: str, needle: str, at_forward: bool = False) -> Callable[..., Any]:
    def register(make: Callable[[int, int], torch.nn.Module]) -> Callable[[int, int], torch.nn.Module]:
        REFUSALS[label] = (make, needle, at_forward)
        return make
    return register


@refusal("a grid that cuts a patch", "sizes that work")
def _cut(rows: int, cols: int) -> torch.nn.Module:
    return build("vit_small_patch16_224", 0, img_size=(224 + 16 * rows, 224 + 16 * cols - 8))


@refusal("an attention pool (global_pool='map')", "global_pool='map'")
def _map(rows: int, cols: int) -> torch.nn.Module:
    return build("vit_small_patch16_224", 0, global_pool="map")


@refusal("a block whose attention mixes tokens otherwise (ParallelScalingBlock)", "blocks.0", at_forward=True)
def _parallel(rows: int, cols: int) -> torch.nn.Module:
    from timm.models.vision_transformer import ParallelScalingBlock

    return build("vit_small_patch16_224", 0, block_fn=ParallelScalingBlock)


def refusal_name(label: str) -> str:
    return f"refuses {label}"


def check_names(rows: int, cols: int) -> list[str]:
    return [exact_name(m) for m in models(rows, cols)] + [refusal_name(label) for label in REFUSALS]


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    rows, cols = int(sys.argv[1]), int(sys.argv[2])
    ctx = Context()
    grid = TileGrid(rows, cols)
    for index, (label, (name, size, kwargs)) in enumerate(models(rows, cols).items()):
        with check(exact_name(label)) as result:
            model = build(name, index, **kwargs)
            torch.manual_seed(100 + index)
            x = torch.randn(2, 3, size, size, dtype=torch.float64)
            errors = check_spatial_exact(model, grid, x, ctx, what=label, rtol=RTOL, grad_floor=1e-6,
                                         reference_rank=index % ctx.world_size)
            net = spatialize(model, grid, ctx)
            with torch.no_grad():
                y = net(scatter_tiles(x, grid, ctx))
            everywhere = ctx.all_reduce(y.clone(), group=None) / ctx.world_size
            assert torch.equal(everywhere, y) or (everywhere - y).abs().max() == 0, "outputs differ across ranks"
            compared = {k: v for k, v in errors.items() if k != "gradients and buffers equal on every rank"}
            result.detail = (f"worst rel err {max(compared.values()):.2e} over {len(compared)} tensors"
                             if compared else "tiles only (compared on another rank)")
    for label, (make, needle, at_forward) in REFUSALS.items():
        with check(refusal_name(label)) as result:
            try:
                net = spatialize(make(rows, cols), grid, ctx)
                if at_forward:
                    net(torch.zeros(1, 3, 224 // rows, 224 // cols, dtype=torch.float64))
            except ConfigError as error:
                assert needle in str(error), f"{needle!r} not in: {error}"
                result.detail = str(error)[:160]
            else:
                raise AssertionError("not refused")
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
