"""The serial reference: the engine's chunks in order, gradient accumulation, one optimizer step per batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.pipeline.reference import SerialRun, serial_chunks


def layers(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
            nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))]


def data(steps: int = 2, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 3, 8, 8, generator=gen, dtype=torch.float64),
             torch.randint(0, 2, (batch,), generator=gen)) for _ in range(steps)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(cfg: dl.ParallelConfig, seed: int = 0) -> SerialRun:
    return dl.serial_reference(cfg, [m.double() for m in layers(seed)], data(), loss_fn=nn.CrossEntropyLoss(),
                               optimizer=sgd)


def test_chunks_are_the_engines_work_units():
    assert serial_chunks(dl.ParallelConfig(split_size=2), 4) == [[0, 1, 2, 3]]
    assert serial_chunks(dl.ParallelConfig(split_size=2, parts=2), 4) == [[0, 1], [2, 3]]
    assert serial_chunks(dl.ParallelConfig(split_size=2, times=1), 4) == [[0, 1], [2, 3]]
    assert serial_chunks(dl.ParallelConfig(split_size=2, parts=2, times=1), 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    synced = dl.ParallelConfig(split_size=2, spatial_size=0, local_dp=2, sync_batchnorm=True)
    assert serial_chunks(synced, 4) == [[0, 1, 2, 3]]           # the copies normalise together
    with pytest.raises(dl.ConfigError, match="batch"):
        serial_chunks(dl.ParallelConfig(split_size=2, parts=2), 3)


def test_one_chunk_is_plain_full_batch_training():
    run = reference(dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4))
    model = nn.Sequential(*[m.double() for m in layers()])
    opt = sgd(model.parameters())
    losses = []
    for images, labels in data():
        opt.zero_grad()
        loss = nn.CrossEntropyLoss()(model(images), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert run.losses == pytest.approx(losses, rel=1e-12)
    for key, value in model.state_dict().items():
        assert torch.allclose(run.state_dict()[key].double(), value.double(), rtol=1e-12, atol=1e-14), key
    assert len(run.step_seconds) == 2 and run.images_per_second(4) > 0


def test_micro_batches_change_batchnorm_so_the_reference_follows_the_chunks():
    full = reference(dl.ParallelConfig(split_size=2))
    parts = reference(dl.ParallelConfig(split_size=2, parts=2))
    gems = reference(dl.ParallelConfig(split_size=2, times=1))
    assert parts.chunks == gems.chunks == [[0, 1], [2, 3]]
    assert parts.losses == pytest.approx(gems.losses, rel=1e-12)    # same chunks -> same run
    weight = "0.0.weight"
    assert not torch.allclose(full.state_dict()[weight], parts.state_dict()[weight], rtol=1e-6)
    mean = parts.state_dict()["0.1.running_mean"]
    assert not torch.allclose(full.state_dict()["0.1.running_mean"], mean, rtol=1e-6)
    assert int(parts.state_dict()["0.1.num_batches_tracked"]) == 4    # one update per chunk
