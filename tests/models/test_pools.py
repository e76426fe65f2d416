"""The head pools of the built-in classifiers (``--pool``, issue 43): every family and pool builds and runs, average
keeps the model as it was, tissue-mean carries the mask through the trunk at each layer's stride and equals the
average pool when every position is tissue."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpi4dl_nb.models.build import build_model
from mpi4dl_nb.models.head import ClassifierHead
from mpi4dl_nb.models.pools import PoolKind
from mpi4dl_nb.models.spec import ModelSpec
from mpi4dl_nb.models.tissue import TissueCarrier

SIZES = {"resnet": dict(num_layers=8, num_filters=4, version=1), "amoebanet": dict(num_layers=3, num_filters=8)}


@pytest.mark.parametrize("family", list(SIZES))
@pytest.mark.parametrize("pool", list(PoolKind))
def test_every_family_and_pool_builds_and_classifies(family, pool):
    torch.manual_seed(0)
    layers = build_model(family, num_classes=3, pool=pool, **SIZES[family])
    head = layers[-1]
    assert isinstance(head, ClassifierHead) and head.pool_kind is pool
    assert all(isinstance(layer, TissueCarrier) for layer in layers[:-1]) == pool.tissue
    x = torch.rand(2, 4 if pool.tissue else 3, 64, 64)
    assert nn.Sequential(*layers).eval()(x).shape == (2, 3)


def test_the_average_pool_keeps_the_model_as_it_was():
    torch.manual_seed(0)
    before = nn.Sequential(*build_model("resnet", num_layers=8, num_filters=4, version=1)).state_dict()
    torch.manual_seed(0)
    after = nn.Sequential(*build_model("resnet", num_layers=8, num_filters=4, version=1, pool="avg")).state_dict()
    assert list(before) == list(after) and all(torch.equal(before[k], after[k]) for k in before)
    assert ModelSpec.of("resnet").pool is PoolKind.AVG and "pool" not in ModelSpec.of("resnet").describe()


def test_tissue_mean_over_all_tissue_is_the_average_pool():
    torch.manual_seed(1)
    tissue = build_model("resnet", num_layers=8, num_filters=4, version=1, num_classes=2, pool="tissue-mean")
    assert [layer.stride for layer in tissue[:-1] if isinstance(layer, TissueCarrier)] == [1, 1, 2, 2]
    average = [layer.layer if isinstance(layer, TissueCarrier) else layer for layer in tissue[:-1]]
    head = ClassifierHead(16, 2)
    head.fc.load_state_dict(tissue[-1].fc.state_dict())
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    with torch.no_grad():
        whole = nn.Sequential(*tissue).double().eval()(torch.cat([x, torch.ones(2, 1, 16, 16).double()], 1))
        want = nn.Sequential(*average, head).double().eval()(x)
        part = nn.Sequential(*tissue).eval()(torch.cat([x, (torch.arange(16) < 8).double().expand(2, 1, 16, 16)], 1))
    torch.testing.assert_close(whole, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(part, want)   # half the canvas without tissue pools otherwise
