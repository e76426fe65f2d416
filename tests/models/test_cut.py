"""layer_list: torchvision and timm CNNs cut into pieces whose forward equals the model's (eval and train mode,
float64), with state-dict keys that map to the model's both ways; models that are not a chain are refused."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.models.cut import layer_list
from mpi4dl_nb.models.pieces import Piece, engine_state_dict, original_state_dict
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

MISSING = missing_modules("torchvision", "timm")


@pytest.fixture(autouse=True)
def _libraries() -> None:
    require_or_skip(MISSING, "models from torchvision and timm", MODELS_EXTRA)


def build(name: str) -> nn.Module:
    """A model of torchvision or timm (3 classes; timm's with head dropout, which the cut must keep)."""
    import timm
    import torchvision

    library, model = name.split(":")
    if library == "timm":
        return timm.create_model(model, num_classes=3, drop_rate=0.2)
    return torchvision.models.get_model(model, num_classes=3)


MODELS = ["torchvision:resnet50", "torchvision:densenet121", "torchvision:efficientnet_b0",
          "torchvision:convnext_tiny", "timm:seresnext26d_32x4d"]


def trained_statistics(model: nn.Module) -> nn.Module:
    """BatchNorm statistics that are not the initial ones (eval mode then differs from train mode)."""
    generator = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.running_mean.copy_(torch.rand(module.running_mean.shape, generator=generator) - 0.5)
            module.running_var.copy_(torch.rand(module.running_var.shape, generator=generator) + 0.5)
    return model


def zeroed(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every tensor zero (a strict load into it must put back every value)."""
    copy = __import__("copy").deepcopy(model)
    with torch.no_grad():
        for tensor in copy.state_dict().values():
            tensor.zero_()
    return copy


@pytest.mark.parametrize("name", MODELS)
def test_cut_equals_the_model_and_keys_map_both_ways(name):
    """Forward of the pieces is the model's in eval and train mode (the same modules in the same order: equal to
    the bit; train mode from one random state, BatchNorm statistics as before); the engine's state dict maps to
    the model's keys and back, both loads strict."""
    torch.manual_seed(0)
    model = trained_statistics(build(name))
    layers = layer_list(model)
    assert len(layers) >= 6 and all(isinstance(layer, Piece) for layer in layers)
    head = layers[-1].paths
    assert "pool" in head[0] or head[0].startswith("adaptive_avg_pool2d"), f"the head starts at the pool: {head}"
    net = nn.Sequential(*layers)
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(net.eval()(x), model.eval()(x))
        before = [b.clone() for b in model.buffers()]
        with torch.random.fork_rng():
            expected = model.train()(x)
        for buffer, value in zip(model.buffers(), before):
            buffer.copy_(value)
        got = net.train()(x)
    assert torch.equal(got, expected)
    fresh = zeroed(model)
    fresh.load_state_dict(original_state_dict(layers, net.state_dict()), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    other = zeroed(net)
    other.load_state_dict(engine_state_dict(list(other), model.state_dict()), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), net.state_dict().values()))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x)


class ModeDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) * 2 if self.training else self.conv(x)


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.conv(x)
        return y, y.mean()


@pytest.mark.parametrize("model,reason", [
    (Residual(), "used 2 times"),
    (TwoOutputs(), "used 2 times"),
    (ModeDependent(), "differs between train and eval mode"),
])
def test_models_that_are_not_a_chain_are_refused(model, reason):
    with pytest.raises(ConfigError, match=reason) as refused:
        layer_list(model)
    assert "build the layer list yourself" in str(refused.value)


def test_a_layer_list_is_returned_as_it_is():
    layers = [nn.Conv2d(3, 4, 3), nn.ReLU()]
    assert layer_list(layers) == layers
