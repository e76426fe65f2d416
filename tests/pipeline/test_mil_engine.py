"""Slide-level pools and gradient accumulation through HybridEngine (issue 43): 2x2 tiles + a layer rank equal one
process for max, tissue-mean and attention heads with BatchNorm in the trunk, with and without ``--accumulate 2``;
the pooled vector handed from the tiles to the layer rank; accumulation on LP+PP, GEMS, DP and SP+PP; recomputation
and bf16 with each pool on tiles (tests/mpi/mil_engine.py, in the shared 5-rank launch)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpi4dl_nb.config import ParallelConfig
from mpi4dl_nb.pipeline.accumulate import GradientSum
from mpi4dl_nb.pipeline.reference import serial_reference
from tests.mpi.mil_engine import CHECKS
from tests.support.battery import shared_job

JOB = shared_job(5, "mil_engine", timeout=400)


def test_pools_and_accumulation_equal_one_process(shared_launch):
    shared_launch(JOB).require(CHECKS)


def test_gradient_sum_applies_the_mean_and_drops_a_skipped_micro_step():
    p = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    sums = GradientSum([p])
    for grad in ([1.0, 2.0], [3.0, 6.0]):
        p.grad = torch.tensor(grad, dtype=torch.float64)
        assert sums.add() and p.grad is None
    sums.apply()
    assert p.grad is not None and p.grad.tolist() == [2.0, 4.0]
    p.grad = None   # the non-finite guard's skip drops every gradient: nothing to add
    assert not GradientSum([p]).add()


def test_serial_reference_accumulates_like_one_big_batch_without_batchnorm():
    torch.manual_seed(0)
    layers = [nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)]
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    cfg = ParallelConfig(split_size=1, spatial_size=0)

    def sgd(params):
        return torch.optim.SGD(params, lr=0.5)

    whole = serial_reference(cfg, [m.double() for m in copy.deepcopy(layers)], [(x, y)], loss_fn=nn.CrossEntropyLoss(),
                             optimizer=sgd)
    halves = serial_reference(cfg, [m.double() for m in copy.deepcopy(layers)], [(x[:2], y[:2]), (x[2:], y[2:])],
                              loss_fn=nn.CrossEntropyLoss(), optimizer=sgd, accumulate=2)
    assert halves.losses == pytest.approx(whole.losses, rel=1e-12)
    for key, value in whole.state_dict().items():
        torch.testing.assert_close(halves.state_dict()[key], value, rtol=1e-12, atol=1e-14)

