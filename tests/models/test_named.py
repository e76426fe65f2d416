"""Named models (torchvision:NAME, timm:NAME, package.module:callable): resolved or refused with the closest names,
recorded in the ModelSpec; pretrained weights loaded by the original keys (a classifier for other classes replaced
with one note), anything else refused naming keys and shapes; the normalisation they expect as the first step."""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.models.external import library, module_model
from mpi4dl_nb.models.normalize import IMAGENET, Normalization, Normalize, normalized
from mpi4dl_nb.models.pieces import Piece
from mpi4dl_nb.models.spec import ModelFamily, ModelSpec, split_model
from mpi4dl_nb.models.weights import load_weights, read_weights
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

MISSING = missing_modules("torchvision", "timm")


@pytest.fixture
def libraries() -> None:
    require_or_skip(MISSING, "models from torchvision and timm", MODELS_EXTRA)


def tiny(num_classes: int = 10) -> nn.Sequential:
    """A model a callable may return (package.module:callable): conv, pool, linear."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, num_classes))


def tiny_list(num_classes: int = 10) -> list[nn.Module]:
    return list(tiny(num_classes))


def not_a_model(num_classes: int = 10) -> int:
    return num_classes


@pytest.mark.parametrize("text,family,source", [
    ("resnet", ModelFamily.RESNET, None), ("AmoebaNet", ModelFamily.AMOEBANET, None),
    ("torchvision:resnet50", ModelFamily.TORCHVISION, "resnet50"), ("timm:efficientnet_b0", ModelFamily.TIMM,
                                                                    "efficientnet_b0"),
    ("tests.models.test_named:tiny", ModelFamily.MODULE, "tests.models.test_named:tiny")])
def test_model_names(text, family, source):
    assert split_model(text) == (family, source)


@pytest.mark.parametrize("text,message", [("resnett", "unknown model 'resnett'; choose one of resnet"),
                                          ("torchvision", "name the model (torchvision:NAME)"),
                                          ("timm:", "the name after ':' is missing")])
def test_bad_model_names(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        split_model(text)


def test_spec_of_a_named_model_round_trips_and_old_specs_read():
    spec = ModelSpec.of("torchvision:resnet50", num_classes=2, normalize=IMAGENET, weights="W.pth")
    assert spec.label == "torchvision:resnet50" and spec.image_multiple == 1
    assert spec.describe() == "torchvision:resnet50, 2 classes, imagenet normalisation, from W.pth"
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    old = {"family": "resnet", "num_layers": 8, "num_filters": 4, "num_classes": 2, "resnet_version": 1}
    assert ModelSpec.from_dict(old) == ModelSpec.of("resnet", num_layers=8, num_filters=4, num_classes=2,
                                                    resnet_version=1)


def test_unknown_names_get_the_closest_ones(libraries):
    with pytest.raises(ConfigError, match=r"torchvision has no model 'resnet500'; closest: resnet50"):
        ModelSpec.of("torchvision:resnet500", num_classes=2).build()
    with pytest.raises(ConfigError, match=r"timm has no model 'efficientnet_b9x'; closest: efficientnet_b"):
        ModelSpec.of("timm:efficientnet_b9x", num_classes=2).build()


def test_callables_and_their_errors():
    assert isinstance(module_model("tests.models.test_named:tiny", 3), nn.Sequential)
    layers = ModelSpec.of("tests.models.test_named:tiny_list", num_classes=3).build()
    assert not isinstance(layers[0], Piece) and layers[-1].out_features == 3   # a layer list stays as it is
    cut = ModelSpec.of("tests.models.test_named:tiny", num_classes=3).build()
    assert all(isinstance(layer, Piece) for layer in cut)
    for target, message in [("no_such_package.models:build", "cannot import module 'no_such_package.models'"),
                            ("tests.models.test_named:tinny", "has no 'tinny'; closest: tiny"),
                            ("tests.models.test_named:not_a_model", "returned a int"),
                            ("tests.models.test_named", "name a callable as package.module:callable")]:
        with pytest.raises(ConfigError, match=message):
            module_model(target, 3)


def test_a_missing_library_names_the_extra():
    with pytest.raises(ConfigError, match=r"needs no_such_vision_lib.*install the 'models' extra: "
                                          r"pip install 'mpi4dl-nb\[models\]'"):
        library("no_such_vision_lib", "torchvision:resnet50")


def test_normalisation_forms_and_the_first_step():
    assert Normalization.parse("imagenet") is IMAGENET and Normalization.parse("none") is None
    assert Normalization.parse("0.5,0.25") == Normalization((0.5,) * 3, (0.25,) * 3)
    assert Normalization.parse("1,2,3,4,5,6").std == (4.0, 5.0, 6.0)
    with pytest.raises(ConfigError, match="--normalize: 'bright'"):
        Normalization.parse("bright")
    layers = normalized(ModelSpec.of("tests.models.test_named:tiny", num_classes=3).build(), IMAGENET)
    assert layers[0].paths[0] == "normalize()" and isinstance(layers[0].get_submodule("normalize()"), Normalize)
    x = torch.rand(1, 3, 8, 8)
    mean, std = torch.tensor(IMAGENET.mean).view(3, 1, 1), torch.tensor(IMAGENET.std).view(3, 1, 1)
    assert torch.allclose(layers[0].get_submodule("normalize()")(x), (x - mean) / std)
    assert "normalize()" not in "".join(nn.Sequential(*layers).state_dict())     # not a weight
    with pytest.raises(ConfigError, match="--normalize: applies to models cut"):
        normalized(tiny_list(3), IMAGENET)


def test_pretrained_weights_load_by_the_models_keys(libraries, tmp_path):
    import torchvision

    torch.manual_seed(0)
    original = torchvision.models.resnet18()                       # 1000 classes, as published weights
    torch.save({"state_dict": original.state_dict()}, tmp_path / "wrapped.pth")
    weights = read_weights(tmp_path / "wrapped.pth")
    spec = ModelSpec.of("torchvision:resnet18", num_classes=2)
    layers = spec.build()
    note = load_weights(layers, weights, model=spec.label)
    assert note == ("--weights: the classifier fc has 1000 outputs in the file and 2 here (--num-classes 2); it is "
                    "replaced by a new one")
    loaded = nn.Sequential(*layers).state_dict()
    assert torch.equal(loaded["0.conv1.weight"], original.conv1.weight) and loaded["9.fc.weight"].shape == (2, 512)
    same = ModelSpec.of("torchvision:resnet18", num_classes=1000).build()
    assert load_weights(same, weights, model="torchvision:resnet18") is None
    with pytest.raises(ConfigError, match=r"--weights: does not fit torchvision:resnet18 \(a state dict of another "
                                          r"architecture\?\): conv1.weight has shape \[4, 3, 3, 3\] in the file, "
                                          r"\[64, 3, 7, 7\] in the model"):
        load_weights(layers, {"conv1.weight": torch.zeros(4, 3, 3, 3), **{k: v for k, v in weights.items()
                                                                          if k != "conv1.weight"}}, model=spec.label)
    with pytest.raises(ConfigError, match=r"none of its 4 keys is a key of torchvision:resnet18 \(its first: "
                                          r"0.weight"):
        load_weights(layers, tiny().state_dict(), model=spec.label)
    partial = {k: v for k, v in original.state_dict().items() if not k.startswith("layer4.1")}
    with pytest.raises(ConfigError, match=r"does not fit torchvision:resnet18: missing layer4.1.conv1.weight"):
        load_weights(ModelSpec.of("torchvision:resnet18", num_classes=1000).build(), partial, model=spec.label)


def test_files_that_hold_no_state_dict_are_refused(tmp_path):
    (tmp_path / "text.pth").write_text("not a checkpoint")
    with pytest.raises(ConfigError, match="--weights: .*text.pth is not a torch state dict"):
        read_weights(tmp_path / "text.pth")
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(ConfigError, match="holds no state dict"):
        read_weights(tmp_path / "list.pth")
    with pytest.raises(ConfigError, match="no such file"):
        read_weights(tmp_path / "missing.pth")
    torch.save({f"module.{k}": v for k, v in tiny().state_dict().items()}, tmp_path / "ddp.pth")
    assert list(read_weights(tmp_path / "ddp.pth")) == list(tiny().state_dict())
