"""LoRA adapters on a cut ViT's blocks (models/lora.py, --lora-rank): readable keys, the network unchanged at the start,
only adapters and head trained, ``.weight`` read adapted (Eva's attention reads it itself), merged into a state dict the
plain timm model loads strictly; recorded in ModelSpec; refusals naming the way out. On tiles and stages:
tests/mpi/foundation_exact.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.models.lora import LoraLinear, LoraSpec, add_adapters, merge_adapters, merged_state, parse_targets
from mpi4dl_nb.models.model_args import parse_model_args
from mpi4dl_nb.models.pieces import original_state_dict
from mpi4dl_nb.models.spec import ModelSpec
from mpi4dl_nb.run.model_choice import LoraChoice, ModelChoice
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

ARGS = "embed_dim=24,num_heads=2,depth=2"
NAME = "timm:vit_tiny_patch16_224"


@pytest.fixture(autouse=True)
def _libraries() -> None:
    require_or_skip(missing_modules("timm"), "timm's vision transformers", MODELS_EXTRA)


RANK_4 = LoraSpec(4)


def spec(lora: LoraSpec | None = RANK_4, name: str = NAME, args: str = ARGS) -> ModelSpec:
    return ModelSpec.of(name, num_classes=3, image_size=32, model_args=parse_model_args(args), lora=lora)


def built(model: ModelSpec, adapters: bool = True, size: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*model.build(size, adapters=adapters)).to(torch.float64).eval()


def randomised(net: nn.Module) -> nn.Module:
    """Nonzero ``lora_b`` (they start at zero), so the adapters change the network."""
    torch.manual_seed(1)
    for module in net.modules():
        if isinstance(module, LoraLinear):
            nn.init.normal_(module.lora_b, std=0.1)
    return net


def test_adapters_start_as_the_plain_network_with_readable_keys_and_only_adapters_and_head_trained():
    adapted, plain = built(spec()), built(spec(), adapters=False)
    x = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    assert torch.equal(adapted(x), plain(x))                          # lora_b starts at zero
    keys = original_state_dict(list(adapted), adapted.state_dict())
    assert keys["blocks.0.attn.qkv.lora_a"].shape == (4, 24) and keys["blocks.0.attn.qkv.lora_b"].shape == (72, 4)
    assert keys["blocks.1.mlp.fc2.weight"].shape == (24, 96) and "blocks.1.mlp.fc2.lora_b" in keys
    trained = {k for k, p in adapted.named_parameters() if p.requires_grad}
    assert trained == {k for k in adapted.state_dict() if k.endswith(("lora_a", "lora_b")) or k.startswith("3.")}
    assert len([k for k in trained if k.endswith("lora_a")]) == 8      # qkv, proj, fc1, fc2 in each of 2 blocks


def test_weight_reads_the_adapted_weight_and_merging_gives_the_plain_timm_model():
    import timm

    model = spec(LoraSpec(2, alpha=3.0, targets=("qkv", "fc2")))
    adapted = randomised(built(model))
    layer = adapted[1].get_submodule("blocks.0.attn.qkv")
    assert isinstance(layer, LoraLinear) and layer.scale == 1.5
    x = torch.rand(5, 24, dtype=torch.float64)
    assert torch.allclose(layer(x), nn.functional.linear(x, layer.weight, layer.bias), atol=1e-14)
    assert not isinstance(adapted[1].get_submodule("blocks.0.attn.proj"), LoraLinear)
    images = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    expected = adapted(images)
    state = original_state_dict(list(adapted), merged_state(adapted.state_dict(), model.lora))
    plain = timm.create_model("vit_tiny_patch16_224", num_classes=3, img_size=32, embed_dim=24, num_heads=2, depth=2)
    plain.load_state_dict(state, strict=True)
    assert torch.allclose(plain.to(torch.float64).eval()(images), expected, atol=1e-12)
    assert merge_adapters(list(adapted)) == 4 and not any(isinstance(m, LoraLinear) for m in adapted.modules())
    assert torch.allclose(adapted(images), expected, atol=1e-12)


def test_an_attention_reading_qkv_weight_itself_sees_the_adapters():
    """EVA-02's attention (separate q and v biases) calls F.linear on ``qkv.weight``: the adapted weight."""
    model = spec(LoraSpec(2), "timm:eva02_tiny_patch14_224", "depth=1")
    net = randomised(built(model, size=28))
    assert net[1].get_submodule("blocks.0.attn").q_bias is not None        # the path that reads qkv.weight
    images = torch.rand(1, 3, 28, 28, dtype=torch.float64)
    merged, plain = built(model, adapters=False, size=28), built(model, adapters=False, size=28)
    merged.load_state_dict(merged_state(net.state_dict(), model.lora), strict=True)
    plain.load_state_dict({k: v for k, v in net.state_dict().items() if "lora" not in k}, strict=True)
    assert torch.allclose(net(images), merged(images), atol=1e-12)
    assert not torch.allclose(net(images), plain(images), atol=1e-6)     # the adapters act through .weight


def test_the_spec_records_the_adapters_and_reads_older_records():
    model = spec(LoraSpec(4, 16.0, ("qkv", "mlp.fc1")))
    again = ModelSpec.from_dict(model.to_dict())
    assert again == model and again.lora is not None and again.lora.paths == ("attn.qkv", "mlp.fc1")
    assert "LoRA rank 4, alpha 16 on qkv,mlp.fc1" in model.describe()
    older = {k: v for k, v in model.to_dict().items() if k != "lora"}
    assert ModelSpec.from_dict(older).lora is None
    choice = ModelChoice(model=NAME, lora=LoraChoice(rank=4))
    assert choice.spec(3).lora == LoraSpec(4, 8.0, ("qkv", "proj", "fc1", "fc2"))     # peft's alpha 8


def test_refusals_name_the_knob_and_the_way_out():
    with pytest.raises(ConfigError, match="--lora-rank.*resnet has none.*drop --lora-rank"):
        ModelChoice(model="resnet", lora=LoraChoice(rank=4))
    with pytest.raises(ConfigError, match="--lora-alpha.*add --lora-rank"):
        LoraChoice(alpha=4.0)
    with pytest.raises(ConfigError, match="--train-blocks.*drop one of them"):
        ModelChoice(model=NAME, train_blocks=1, lora=LoraChoice(rank=4))
    with pytest.raises(ValueError, match="'fc3' is not one of qkv, proj, fc1, fc2"):
        parse_targets("qkv,fc3")
    with pytest.raises(ConfigError, match=r"--lora-targets: mlp.fc3: blocks.0 of .* its linear layers: attn.proj"):
        spec(LoraSpec(2, targets=("mlp.fc3",))).build(32)
    with pytest.raises(ConfigError, match="--lora-rank.*a CNN has none.*drop --lora-rank, or choose a ViT"):
        add_adapters(ModelSpec.of("resnet", num_layers=11, num_filters=4).build(32), LoraSpec(2), "a CNN")
    with pytest.raises(ValueError, match="--lora-rank: a resnet has no transformer blocks"):
        ModelSpec.of("resnet", lora=LoraSpec(2))
