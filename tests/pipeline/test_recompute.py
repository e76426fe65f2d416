"""Activation recomputation (pipeline/recompute.py) in one process: segments, exactness, memory, refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.config import as_checkpoint_setting
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.measure.usage import ActivationMeter
from mpi4dl_nb.pipeline import recompute
from mpi4dl_nb.pipeline.recompute import checkpointed, segment_bounds
from tests.support.models import build


def test_segment_bounds_cover_the_stage_in_order():
    assert segment_bounds(4, "every") == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert segment_bounds(10, "blocks") == [(0, 4), (4, 8), (8, 10)]
    assert segment_bounds(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert segment_bounds(3, 7) == [(0, 3)]
    with pytest.raises(ValueError):
        segment_bounds(3, "sometimes")


def test_setting_parsed_and_refused_with_the_way_out():
    assert as_checkpoint_setting(None) is None and as_checkpoint_setting("none") is None
    assert as_checkpoint_setting("3") == 3 and as_checkpoint_setting("blocks") == "blocks"
    with pytest.raises(ConfigError, match="every"):
        as_checkpoint_setting("all")
    with pytest.raises(ConfigError, match="halo_d2"):
        dl.ParallelConfig(checkpoint_activations="every", halo_d2=True)
    with pytest.raises(ConfigError, match="sync_batchnorm"):
        dl.ParallelConfig(checkpoint_activations="every", sync_batchnorm=True)
    assert dl.ParallelConfig(checkpoint_activations=2).as_dict()["checkpoint_activations"] == 2


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, meter: ActivationMeter | None = None) -> float:
    loss_fn = nn.CrossEntropyLoss()
    if meter is None:
        loss = loss_fn(model(x), y)
        loss.backward()
    else:
        with meter:
            loss = loss_fn(model(x), y)
            loss.backward()
    return loss.item()


def _data(batch: int = 4, image: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(batch, 3, image, image, generator=gen, dtype=torch.float64),
            torch.randint(0, 5, (batch,), generator=gen))


@pytest.mark.parametrize("setting", ["every", "blocks", 2])
def test_same_loss_gradients_and_running_stats_as_plain(setting):
    """Without the engine's BatchNorm ledger: the recomputed forward must not update running stats again."""
    plain = nn.Sequential(*build("resnet"))
    again = copy.deepcopy(plain)
    ckpt = checkpointed(again, setting)
    x, y = _data()
    assert _step(ckpt, x, y) == _step(plain, x, y)
    for (name, a), b in zip(plain.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(plain.named_parameters(), again.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_control_running_stats_updated_twice_would_differ(monkeypatch):
    """The throw-away buffers matter: letting the recomputation update them changes the state."""
    plain = nn.Sequential(*build("resnet"))
    again = copy.deepcopy(plain)
    original = recompute.spare_running_stats
    monkeypatch.setattr(recompute, "spare_running_stats", lambda norms: original([]))
    x, y = _data()
    _step(plain, x, y)
    _step(checkpointed(again, "every"), x, y)
    assert not torch.equal(plain.state_dict()["0.bn.running_mean"], again.state_dict()["0.bn.running_mean"])


def test_dropout_masks_replayed():
    torch.manual_seed(3)
    layers = [nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Dropout(0.5)), nn.Flatten(), nn.Linear(4 * 64, 5)]
    plain = nn.Sequential(*layers).double()
    again = copy.deepcopy(plain)
    x, y = _data(2, 8)
    torch.manual_seed(9)
    want = _step(plain, x, y)
    torch.manual_seed(9)
    assert _step(checkpointed(again, "every"), x, y) == want
    assert torch.equal(plain[0][0].weight.grad, again[0][0].weight.grad)


def test_counted_peak_falls():
    plain = nn.Sequential(*build("resnet"))
    again = copy.deepcopy(plain)
    x, y = _data(2, 64)
    peaks = []
    for model in (plain, checkpointed(again, "every")):
        meter = ActivationMeter(exclude=list(model.parameters()))
        _step(model, x, y, meter)
        peaks.append(meter.peak)
        assert meter.current == 0
    assert peaks[1] < 0.7 * peaks[0], peaks


def test_tuple_payloads_and_no_grad_eval():
    """U-Net layers pass tuples; under no_grad the segments just run."""
    plain = nn.Sequential(*build("unet"))
    again = copy.deepcopy(plain)
    ckpt = checkpointed(again, "every")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 16, 16, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (2, 16, 16), generator=gen)
    assert _step(ckpt, x, y) == _step(plain, x, y)
    for a, b in zip(plain.parameters(), again.parameters()):
        assert torch.equal(a.grad, b.grad)
    with torch.no_grad():
        plain.eval(), ckpt.eval()
        assert torch.equal(plain(x), ckpt(x))
