"""Layer-wise learning-rate decay (pipeline/layer_decay.py, --layer-decay): BEiT's rates per parameter group on a tiny
ViT, kept by the schedule step by step; recorded with the optimizer; refused for F outside (0, 1] and for a model
without blocks. Across stages and tiles: tests/mpi/foundation_exact.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.models.model_args import parse_model_args
from mpi4dl_nb.models.spec import ModelSpec
from mpi4dl_nb.models.vit import layer_decay_scales
from mpi4dl_nb.pipeline.layer_decay import SCALE, ScaledOptimizer, decay_scales, make_optimizer
from mpi4dl_nb.pipeline.optim import LRSchedule, OptimizerKind, OptimizerSpec
from mpi4dl_nb.run.training_spec import OptimizerChoice
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

LR, F, DEPTH = 0.1, 0.75, 3


def tiny_vit() -> list[nn.Module]:
    require_or_skip(missing_modules("timm"), "timm's vision transformers", MODELS_EXTRA)
    args = parse_model_args(f"embed_dim=24,num_heads=2,depth={DEPTH},reg_tokens=2")
    return ModelSpec.of("timm:vit_tiny_patch16_224", num_classes=2, image_size=32, model_args=args).build(32)


def test_the_groups_give_beit_rates_and_the_schedule_multiplies_each():
    layers = tiny_vit()
    named = list(nn.Sequential(*layers).named_parameters())
    spec = OptimizerSpec.of(OptimizerKind.ADAMW, LR, layer_decay=F)
    optimizer = make_optimizer(ScaledOptimizer(spec, layer_decay_scales(layers, F, "the ViT")), named)
    rate = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    by_key = {key: rate[id(p)] for key, p in named}
    embedding = ("0.cls_token", "0.reg_token", "0.pos_embed", "0.patch_embed.proj.weight")
    assert all(by_key[k] == pytest.approx(LR * F ** (DEPTH + 1)) for k in embedding)
    for block in range(DEPTH):                    # block i is layer i + 1: lr F^(L - i)
        keys = [k for k in by_key if k.startswith(f"{block + 1}.blocks.{block}.")]
        assert keys and all(by_key[k] == pytest.approx(LR * F ** (DEPTH - block)) for k in keys)
    assert by_key["4.norm.weight"] == by_key["4.head.weight"] == LR
    assert [group[SCALE] for group in optimizer.param_groups] == sorted({F ** j for j in range(DEPTH + 2)},
                                                                         reverse=True)
    schedule = LRSchedule("constant", total_steps=4, warmup_steps=1)
    schedule.apply(optimizer, 0)                  # warm-up: half of each group's own peak
    assert all(group["lr"] == pytest.approx(LR * group[SCALE] / 2) for group in optimizer.param_groups)
    schedule.apply(optimizer, 1)
    assert all(group["lr"] == pytest.approx(LR * group[SCALE]) for group in optimizer.param_groups)


def test_scales_come_from_whole_model_keys_so_a_stage_agrees_with_the_whole_model():
    keys = ["0.cls_token", "1.blocks.0.w", "2.blocks.1.attn.qkv.lora_a", "3.head.weight"]
    scales = decay_scales(keys, [1, 2], 0.5)
    assert scales == {"0.cls_token": 0.125, "1.blocks.0.w": 0.25, "2.blocks.1.attn.qkv.lora_a": 0.5,
                      "3.head.weight": 1.0}
    assert decay_scales(keys[2:], [1, 2], 0.5) == {k: scales[k] for k in keys[2:]}   # a later stage alone


def test_recorded_with_the_optimizer_and_older_records_read():
    spec = OptimizerSpec.of("sgd", LR, layer_decay=F)
    assert OptimizerSpec.from_dict(spec.to_dict()) == spec and "layer decay 0.75" in spec.describe()
    older = {k: v for k, v in spec.to_dict().items() if k != "layer_decay"}
    assert OptimizerSpec.from_dict(older).layer_decay is None
    assert OptimizerChoice(layer_decay=F).spec.layer_decay == F


@pytest.mark.parametrize("factor", [0.0, 1.5, -0.5])
def test_a_factor_outside_zero_one_is_refused(factor):
    with pytest.raises(ConfigError, match="--layer-decay: must be a number > 0 and <= 1"):
        OptimizerChoice(layer_decay=factor)
    with pytest.raises(ConfigError, match=r"--layer-decay.*\(0, 1\]"):
        decay_scales(["0.w"], [0], factor)


def test_a_model_without_blocks_is_refused_naming_it_and_the_way_out():
    layers = ModelSpec.of("resnet", num_layers=11, num_filters=4).build(32)
    with pytest.raises(ConfigError, match="--layer-decay.*resnet has no transformer blocks.*drop --layer-decay"):
        layer_decay_scales(layers, F, "resnet")
    with pytest.raises(TypeError, match="whole-model names"):
        ScaledOptimizer(OptimizerSpec(), {})([nn.Parameter(torch.zeros(1))])
