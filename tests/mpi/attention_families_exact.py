"""MaxViT (block + grid attention) and EfficientViT (linear attention) on tiles equal one process (issue 53), and
ConvNeXt-V2's GRN stays exact.

Float64, timm's own initialisation (seeded), training mode, batch 1 or 2: output, input gradient, every parameter
gradient (tile shares summed by ``reduce_tile_gradients``), BatchNorm buffers, then an eval forward; within 1e-10
relative. Each model's serial reference runs on one rank (check i on rank i mod 4).

* ``maxvit_tiny_rw_224`` at 224 px with one block per stage (``depths=(1, 1, 1, 1)``: the same block code as at its
  depths (2, 2, 5, 2); ``MPI4DL_MAXVIT_FULL_DEPTH=1`` builds it whole): token grids 56, 28, 14 and 7 with 7 x 7
  windows and grids. On 2x2 the block windows stay inside tiles down to 14 x 14 and the last stage's one 7 x 7
  window straddles the four (uneven 4/3) tiles; on 1x4 the block windows of the 14 x 14 stage straddle tiles too.
  Grid windows always gather tokens from every tile.
* ``maxvit_rmlp_pico_rw_256`` (relative position MLP instead of the bias table) at 256 px, one block per stage, in
  eval mode (in training, the MLP's dropout would draw its mask per window owner: refused, checked by name).
* ``maxvit_pico_rw_256`` with ``transformer_use_nchw_attn=True`` (timm's NCHW ``PartitionAttention2d``), 256 px.
* ``maxxvitv2_nano_rw_256`` (ConvNeXt blocks instead of MBConv) at 256 px, one block per stage.
* ``efficientvit_b0`` at 224 px (LiteMLA at 14 x 14 and 7 x 7, the last uneven). timm computes LiteMLA's attention in
  float32 (``q.float()``): the float64 reference keeps the input's dtype there (``float64_linear_attention``), which
  is what the tiles compute in a float64 run; against timm's unchanged float32 attention the tiles agree to 1e-5.
* ``efficientvit_l1`` (timm's EfficientVitLarge: LiteMLA with other scales) at 160 px, one block per stage.
* ``convnextv2_atto`` (GRN: a norm over the image) at 224 px, batch 1.

Usage: python -m tests.mpi.attention_families_exact   (4 ranks: every case on 2x2, MaxViT also on 1x4, in one launch)
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tiles import scatter_tiles
from tests.support.checks import Checks, run_checks
from tests.support.exactness import SAME_ON_EVERY_RANK, check_spatial_exact

RTOL = 1e-10
# parameter gradients compared relative to at least this fraction of the model's largest: EfficientViT's stem and
# stage-0 BatchNorm biases feed a residual stream every later path normalises, their gradients are zero in exact
# arithmetic (6e-16 of the largest), rounding noise that a smaller floor would compare as signal
GRAD_FLOOR = 1e-5
FULL_DEPTH = os.environ.get("MPI4DL_MAXVIT_FULL_DEPTH") == "1"


def _attention_in_input_dtype(self: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """timm's ``LiteMLA._attn`` without its cast to float32 (a float64 reference)."""
    out = q @ (k.transpose(-1, -2) @ v)
    return out[..., :-1] / (out[..., -1:] + float(self.eps))


def float64_linear_attention(model: nn.Module) -> nn.Module:
    """``model`` with every LiteMLA's attention in its input's dtype (timm's casts to float32)."""
    from timm.models.efficientvit_mit import LiteMLA

    for module in model.modules():
        if isinstance(module, LiteMLA):
            module._attn = types.MethodType(_attention_in_input_dtype, module)   # type: ignore[method-assign]
    return model


def build(name: str, seed: int, **kwargs: Any) -> nn.Module:
    import timm

    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs).double()
    with torch.no_grad():   # BatchNorm's affine and GRN's gamma/beta at non-trivial values
        for pname, p in model.named_parameters():
            if pname.endswith(("bn.weight", "norm.weight", "grn.weight", "grn.bias", "gamma", "beta")):
                p.copy_(torch.rand_like(p) + 0.5 if pname.endswith("weight") else torch.randn_like(p) * 0.5)
    return model


@dataclass(frozen=True)
class Case:
    """One model against one process: ``make(seed)``, its input, tolerance, and train or eval mode."""

    make: Callable[[int], nn.Module]
    size: int
    batch: int
    rtol: float = RTOL
    train: bool = True


CASES: dict[str, Case] = {
    "maxvit_tiny_rw_224": Case(lambda seed: build("maxvit_tiny_rw_224", seed,
                                                  **({} if FULL_DEPTH else {"depths": (1, 1, 1, 1)})), 224, 1),
    "maxvit_rmlp_pico_rw_256 (relative position MLP, eval mode)": Case(
        lambda seed: build("maxvit_rmlp_pico_rw_256", seed, depths=(1, 1, 1, 1)), 256, 1, train=False),
    "maxvit_pico_rw_256 with NCHW attention (PartitionAttention2d)": Case(
        lambda seed: build("maxvit_pico_rw_256", seed, depths=(1, 1, 1, 1), transformer_use_nchw_attn=True), 256, 1),
    "maxxvitv2_nano_rw_256 (ConvNeXt blocks, one per stage)": Case(
        lambda seed: build("maxxvitv2_nano_rw_256", seed, depths=(1, 1, 1, 1)), 256, 1),
    "efficientvit_b0": Case(lambda seed: float64_linear_attention(build("efficientvit_b0", seed)), 224, 2),
    "efficientvit_l1 (EfficientVitLarge, one block per stage)": Case(
        lambda seed: float64_linear_attention(build("efficientvit_l1", seed, depths=(1, 1, 1, 1, 1))), 160, 1),
    "efficientvit_b0 against timm's float32 attention": Case(lambda seed: build("efficientvit_b0", seed), 224, 2,
                                                             rtol=1e-5),
    "convnextv2_atto (GRN)": Case(lambda seed: build("convnextv2_atto", seed), 224, 1),
}
GRIDS = ((2, 2), (1, 4))
ON_1X4 = ("maxvit_tiny_rw_224",)   # its 14 x 14 stage's block windows straddle the 1x4 tiles


def cases(rows: int, cols: int) -> list[str]:
    return list(CASES) if (rows, cols) == (2, 2) else list(ON_1X4)


REFUSAL = "2x2: refuses the relative position MLP's dropout in training, naming it"


def check_names() -> list[str]:
    return [exact_name(rows, cols, label) for rows, cols in GRIDS for label in cases(rows, cols)] + [REFUSAL]


def check_refusal(ctx: Context) -> str:
    """maxvit_rmlp_pico_rw_256 in training: its relative position MLP's dropout (p=0.125) is refused by name."""
    grid = TileGrid(2, 2)
    net = spatialize(build("maxvit_rmlp_pico_rw_256", 0, depths=(1, 1, 1, 1)).train(), grid, ctx)
    try:
        net(scatter_tiles(torch.zeros(1, 3, 256, 256, dtype=torch.float64), grid, ctx))
    except ConfigError as error:
        assert "'stages.0.blocks.0.attn_block.attn.rel_pos.mlp.drop1' (Dropout, p=0.125)" in str(error), str(error)
        return str(error)[:160]
    raise AssertionError("not refused")


def exact_name(rows: int, cols: int, label: str) -> str:
    return f"{rows}x{cols}: {label} equals one process"


def check_case(ctx: Context, grid: TileGrid, index: int, label: str) -> str:
    case = CASES[label]
    model = case.make(index)
    torch.manual_seed(100 + index)
    x = torch.randn(case.batch, 3, case.size, case.size, dtype=torch.float64)
    errors = check_spatial_exact(model, grid, x, ctx, what=label, rtol=case.rtol, grad_floor=GRAD_FLOOR,
                                 train=case.train, reference_rank=index % ctx.world_size)
    compared = {k: v for k, v in errors.items() if k != SAME_ON_EVERY_RANK}
    return (f"worst rel err {max(compared.values()):.2e} over {len(compared)} tensors (output {errors['output']:.1e})"
            if compared else "compared on another rank")


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = Context()
    assert ctx.world_size == 4, "run with 4 ranks"
    index = 0
    for rows, cols in GRIDS:
        grid = TileGrid(rows, cols)
        for label in cases(rows, cols):
            with check(exact_name(rows, cols, label)) as result:
                result.detail = check_case(ctx, grid, index, label)
            index += 1
    with check(REFUSAL) as result:
        result.detail = check_refusal(ctx)
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
