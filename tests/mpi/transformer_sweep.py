"""Every other timm transformer on tiles: exact, or refused naming the module and the op (issue 52).

One model of each timm module with attention or token mixing (the ViT family's relatives: BEiT, CaiT, CoaT, ConViT,
CrossViT, XCiT, PiT, PVT-v2, Twins, TNT, VOLO, MViT-v2, Hiera, EfficientFormer, MobileViT, ... and the hybrids that
are plain CNNs on tiles), built small (one block, narrow, no stochastic depth where timm's constructor takes it),
float64, spatialized on a 1x2 tile grid. Each must either equal one process (output, input gradient, every parameter
gradient within 1e-10 relative, ``check_spatial_exact``) or raise a ``ConfigError`` naming a layer of the model
(``layer '<name>' (<Class>)``) before or at its first forward on tiles: never a crash of another kind, never a result
that differs. Swin, MaxViT/CoAtNet, EfficientViT and LeViT have checks of their own (issue 53).

Usage: python -m tests.mpi.transformer_sweep   (2 ranks)
Named checks: ``check_names()``.
"""

from __future__ import annotations

from typing import Any

import torch

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.support.checks import Checks, run_checks
from tests.support.exactness import check_spatial_exact

RTOL = 1e-10
GRID = TileGrid(1, 2)
NARROW = {"depth": 1, "embed_dim": 64, "num_heads": 2}
ONE_PER_STAGE = {"depths": (1, 1, 1, 1)}
ONE_LAYER_PER_STAGE = {"layers": (1, 1, 1, 1)}

# timm module -> (model, image size, constructor keywords); one model per module, the smallest timm lists (or the
# module's model class, capitalised, where the named models fix the sizes the keywords would shrink)
MODELS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "beit": ("beit_base_patch16_224", 224, NARROW),
    "byoanet": ("halonet_h1", 256, {}),
    "cait": ("cait_xxs24_224", 224, NARROW),
    "coat": ("coat_tiny", 224, {}),
    "convit": ("convit_tiny", 224, NARROW),
    "crossvit": ("crossvit_tiny_240", 240, {}),
    "csatv2": ("csatv2", 256, {}),
    "davit": ("davit_tiny", 224, ONE_PER_STAGE),
    "deepseek_vit": ("deepseek_vit_412m", 224, NARROW),
    "deit": ("deit_tiny_patch16_224", 224, NARROW),
    "edgenext": ("edgenext_xx_small", 256, ONE_PER_STAGE),
    "efficientformer": ("efficientformer_l1", 224, ONE_PER_STAGE),
    "efficientformer_v2": ("efficientformerv2_s0", 224, ONE_PER_STAGE),
    "efficientvim": ("efficientvim_m1", 224, {}),
    "eva": ("vit_tiny_patch16_dinov3_qkvb", 256, NARROW),
    "fastvit": ("fastvit_t8", 256, ONE_LAYER_PER_STAGE),
    "focalnet": ("FocalNet", 224, {"depths": (1, 1, 1, 1), "embed_dim": 32}),   # the class: the named ones fix depths
    "gcvit": ("gcvit_xxtiny", 224, {}),
    "gemma4_vit": ("gemma4_vit_167m", 256, NARROW),
    "hiera": ("hiera_tiny_224", 224, {}),
    "iformer": ("iformer_t", 224, {}),
    "lowformer": ("lowformer_b0", 224, {}),
    "mlp_mixer": ("gmlp_ti16_224", 224, {}),
    "mobilevit": ("mobilevit_xxs", 256, {}),
    "mvitv2": ("mvitv2_tiny", 224, {}),
    "naflexvit": ("naflexvit_base_patch16_parfac_gap", 256, NARROW),
    "nest": ("nest_tiny", 224, {}),
    "nextvit": ("nextvit_small", 224, {}),
    "pit": ("pit_ti_224", 224, {}),
    "pvt_v2": ("pvt_v2_b0", 224, ONE_PER_STAGE),
    "qwen3_vit": ("qwen3_vit_88m", 256, NARROW),
    "sequencer": ("sequencer2d_s", 224, ONE_LAYER_PER_STAGE),
    "shvit": ("shvit_s1", 224, {}),
    "swiftformer": ("swiftformer_xs", 224, ONE_LAYER_PER_STAGE),
    "tiny_vit": ("tiny_vit_5m_224", 224, ONE_PER_STAGE),
    "tnt": ("tnt_s_legacy_patch16_224", 224, {"depth": 1, "embed_dim": 64}),
    "twins": ("twins_svt_small", 224, ONE_PER_STAGE),
    "visformer": ("visformer_tiny", 224, NARROW),
    "vision_transformer_relpos": ("test_vit_relpos", 160, NARROW),
    "vision_transformer_sam": ("samvit_base_patch16_224", 224, NARROW),
    "vitamin": ("vitamin_small_224", 224, {"depth": 1}),
    "volo": ("volo_d1_224", 224, {}),
    "xcit": ("xcit_nano_12_p8_224", 224, NARROW),
}


def check_name(module: str) -> str:
    return f"timm's {module}: exact or refused naming the layer"


def check_names() -> list[str]:
    return [check_name(module) for module in MODELS]


def build(module: str, name: str, kwargs: dict[str, Any]) -> torch.nn.Module:
    """The model, float64, seeded; without stochastic depth where the constructor takes ``drop_path_rate``
    (its random masks are refused on tiles by themselves, which would hide the attention behind them)."""
    import importlib

    import timm

    for extra in ({"drop_path_rate": 0.0}, {}):
        torch.manual_seed(0)
        try:
            if name[0].isupper():
                model_class = getattr(importlib.import_module(f"timm.models.{module}"), name)
                return model_class(**kwargs, **extra).double()
            return timm.create_model(name, pretrained=False, **kwargs, **extra).double()
        except TypeError:
            continue
    raise AssertionError(f"timm.create_model({name!r}, **{kwargs}) failed")


def outcome(ctx: Context, module: str, name: str, size: int, kwargs: dict[str, Any]) -> str:
    """``exact ...`` or ``refused: ...``; raises AssertionError on anything else."""
    model = build(module, name, kwargs)
    x = torch.randn(1, 3, size, size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    try:
        errors = check_spatial_exact(model, GRID, x, ctx, what=name, rtol=RTOL, grad_floor=1e-6, reference_rank=0)
    except ConfigError as error:
        assert "layer '" in str(error), f"refused without naming a layer: {error}"
        return f"refused: {str(error)[:160]}"
    worst = max(errors.values()) if errors else 0.0
    return f"exact, worst rel err {worst:.1e}"


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = Context()
    assert ctx.world_size == GRID.rows * GRID.cols, f"run with {GRID.rows * GRID.cols} ranks"
    for module, (name, size, kwargs) in MODELS.items():
        with check(check_name(module)) as result:
            result.detail = f"{name}: {outcome(ctx, module, name, size, kwargs)}"
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
