"""``--pool max|attention`` for named classifiers (issue 43): a torchvision or timm model's global average pool
replaced, every other piece and the pretrained weights of the trunk and classifier kept, the spec recorded; models
without a global average pool where it is expected, and tissue-mean, refused; 4 tiles + a layer rank train a
torchvision ResNet-18 so pooled as one process does (``tests/mpi/named_pool_exact.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.infer.fully_conv import fully_convolutional
from mpi4dl_nb.models.named_pool import PooledMap, replaced_pool, with_named_pool
from mpi4dl_nb.models.pieces import Piece
from mpi4dl_nb.models.pools import AttentionMILPool, PoolKind
from mpi4dl_nb.models.spec import ModelSpec
from mpi4dl_nb.models.weights import load_weights
from mpi4dl_nb.run.job import TrainJob
from tests.mpi.named_pool_exact import POOLS, case_name
from tests.support.battery import shared_job

JOB = shared_job(5, "named_pool_exact", timeout=120)
MODELS = {"torchvision:resnet18": "avgpool", "timm:resnet10t": "global_pool.pool"}


@pytest.fixture(scope="module")
def libraries() -> None:
    pytest.importorskip("torchvision")
    pytest.importorskip("timm")


def head_of(layers: list[nn.Module]) -> Piece:
    assert isinstance(layers[-1], Piece)
    return layers[-1]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("pool", ["max", "attention"])
def test_the_average_pool_is_replaced_and_the_rest_kept(libraries, model, pool):
    torch.manual_seed(0)
    plain = ModelSpec.of(model, num_classes=3).build()
    torch.manual_seed(0)
    spec = ModelSpec.of(model, num_classes=3, pool=pool)
    pooled = spec.build()
    head = head_of(pooled)
    path = MODELS[model]
    assert head.paths == head_of(plain).paths and head.paths[0] == path
    replaced = head.get_submodule(path)
    assert isinstance(replaced, PooledMap) and replaced.kind is PoolKind(pool)
    assert replaced_pool(pooled) is replaced.kind and replaced_pool(plain) is None
    before, after = nn.Sequential(*plain).state_dict(), nn.Sequential(*pooled).state_dict()
    new = [k for k in after if k not in before]
    assert all(torch.equal(before[k], after[k]) for k in before)        # trunk and classifier drawn alike
    assert bool(new) == (pool == "attention") and all(".pool." in k for k in new)
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        out, average = nn.Sequential(*pooled).eval()(x), nn.Sequential(*plain).eval()(x)
    assert out.shape == (2, 3) and not torch.allclose(out, average)
    assert f"{pool} pool" in spec.describe() and ModelSpec.from_dict(spec.to_dict()) == spec
    rebuilt = nn.Sequential(*ModelSpec.from_dict(spec.to_dict()).build())      # what evaluate and infer build
    rebuilt.load_state_dict(nn.Sequential(*pooled).state_dict(), strict=True)


def test_the_train_flags_take_max_and_attention_for_a_named_model(libraries):
    job = TrainJob.of(model="torchvision:resnet18", pool="attention", num_classes=2).check()
    assert job.model.pool is PoolKind.ATTENTION and job.model.input_channels == 3
    with pytest.raises(ConfigError, match="--pool: --pool tissue-mean needs the tissue mask carried through the trunk"):
        TrainJob.of(model="torchvision:resnet18", pool="tissue-mean")


def test_max_is_the_global_maximum_and_attention_weights_positions(libraries):
    torch.manual_seed(1)
    layers = ModelSpec.of("torchvision:resnet18", num_classes=2, pool="attention").build()
    *trunk, head = layers
    pool = head_of(layers).get_submodule("avgpool")
    assert isinstance(pool, PooledMap) and isinstance(pool.pool, AttentionMILPool)
    assert pool.pool.V.in_channels == 512                              # resnet18's feature channels
    h = torch.randn(2, 512, 3, 3, dtype=torch.float64)
    attention = pool.double()
    scores = attention.pool.scores(h).flatten(2).softmax(-1)
    want = (h.flatten(2) * scores).sum(-1)
    torch.testing.assert_close(attention(h), want[:, :, None, None], rtol=1e-12, atol=1e-12)
    maxed = head_of(ModelSpec.of("torchvision:resnet18", num_classes=2, pool="max").build()).get_submodule("avgpool")
    assert torch.equal(maxed(h).flatten(1), h.flatten(2).amax(-1))


def test_pretrained_weights_load_into_the_trunk_and_the_pool_keeps_its_seeded_draw(libraries, tmp_path):
    import torchvision

    torch.manual_seed(0)
    original = torchvision.models.resnet18()
    torch.manual_seed(5)
    spec = ModelSpec.of("torchvision:resnet18", num_classes=1000, pool="attention")
    layers = spec.build()
    drawn = {k: v.clone() for k, v in nn.Sequential(*layers).state_dict().items() if ".pool." in k}
    assert load_weights(layers, original.state_dict(), model=spec.label) is None
    loaded = nn.Sequential(*layers).state_dict()
    assert torch.equal(loaded["0.conv1.weight"], original.conv1.weight)
    assert torch.equal(loaded["9.fc.weight"], original.fc.weight)
    assert drawn and all(torch.equal(loaded[k], v) for k, v in drawn.items())
    torch.manual_seed(5)
    again = nn.Sequential(*ModelSpec.of("torchvision:resnet18", num_classes=1000, pool="attention").build())
    assert all(torch.equal(again.state_dict()[k], v) for k, v in drawn.items())   # the seed draws the pool


def test_a_functional_pool_is_replaced_under_a_module_path(libraries):
    layers = ModelSpec.of("torchvision:densenet121", num_classes=2, pool="attention").build()
    head = head_of(layers)
    assert head.paths[0] == "head_pool" and all("()" not in k for k in nn.Sequential(*layers).state_dict())


def test_a_model_without_the_expected_pool_or_tissue_mean_is_refused(libraries):
    layers = [nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 2)]
    with pytest.raises(ConfigError, match=r"--pool: --pool attention: cannot find the global average pool of "
                                          r"mine:make to replace: expected avgpool \(torchvision\).*found a Linear"):
        with_named_pool(layers, PoolKind.ATTENTION, "mine:make", 3, feature_channels=4)
    with pytest.raises(ValueError, match="--pool tissue-mean: only the built-in classifiers .* carry the tissue mask"):
        ModelSpec.of("torchvision:resnet18", pool="tissue-mean")
    with pytest.raises(ValueError, match="--pool max: a unet outputs a class per pixel"):
        ModelSpec.of("unet", pool="max")


def test_infer_refuses_a_replaced_pool_as_it_does_the_built_in_ones(libraries):
    layers = ModelSpec.of("torchvision:resnet18", num_classes=2, pool="max").build()
    with pytest.raises(ConfigError, match=r"its head pools the whole canvas by max \(--pool\)"):
        fully_convolutional(layers, 64)


def test_five_ranks_train_a_pooled_torchvision_resnet_as_one_process(shared_launch):
    shared_launch(JOB).require_clean([case_name(pool) for pool in POOLS])
